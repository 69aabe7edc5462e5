"""Borrowed CPU-backend internals: gloo's rendezvous keys and records, and the address gloo listens on."""

from __future__ import annotations

import socket
import struct
from typing import Any

# -- the CPU backend's rendezvous keys ---------------------------------------------------------

# Keys the CPU (gloo) backend writes into the coordination service's key-value store, once
# per (incarnation, device list). After a restart they are stale: the new incarnation's
# gloo rendezvous fails with ALREADY_EXISTS, and process 0's backend start fails on the
# old topology. Names read in XLA's CPU collectives and jax's CPU client (no API).
GLOO_KEY_PREFIX = "cpu:gloo"
GLOBAL_TOPOLOGY_KEY = "cpu:global_topology/cpu"


def delete_stale_cpu_keys(client: Any, *, topology: bool) -> None:
    """Delete the gloo rendezvous keys (and with ``topology`` the global topology key).

    Deleting an absent key succeeds, so any error here is real (a renamed key shows up
    in ``tests/test_private_api.py``, which checks that the keys exist and vanish).
    """
    client.key_value_delete(GLOO_KEY_PREFIX)
    if topology:
        client.key_value_delete(GLOBAL_TOPOLOGY_KEY)


def gloo_listen_address(value: bytes) -> tuple[bytes, int] | None:
    """``(packed IP, port)`` that the gloo rendezvous value ``value`` advertises: where the
    process that wrote it listens for its gloo peers (None if it does not parse).

    Private: gloo's rank record (``gloo/rendezvous``), which XLA's CPU collectives write
    under :data:`GLOO_KEY_PREFIX`: a length-prefixed host name, then a length-prefixed
    transport address (the TCP transport's ``sockaddr_storage`` and a sequence number), then
    pair identifiers; lengths are native 64-bit integers. No API names the listener. The
    breaker tells gloo's connections by it (``tests/test_breaker.py`` checks that it still
    ends a collective).
    """
    try:
        (name_len,) = struct.unpack_from("=Q", value, 0)
        (addr_len,) = struct.unpack_from("=Q", value, 8 + name_len)
        addr = value[16 + name_len:16 + name_len + addr_len]
        (family,) = struct.unpack_from("=H", addr, 0)
        (port,) = struct.unpack_from("!H", addr, 2)
    except struct.error:
        return None
    if family == socket.AF_INET and len(addr) >= 8:
        return addr[4:8], port
    if family == socket.AF_INET6 and len(addr) >= 24:
        return addr[8:24], port
    return None


def delete_global_topology_key(client: Any) -> None:
    """Process 0 rewrites the global topology when its backend starts (see above)."""
    client.key_value_delete(GLOBAL_TOPOLOGY_KEY)


# -- the CPU collectives' address ----------------------------------------------------------------

def use_gloo_address(*, interface: str | None = None, hostname: str | None = None) -> None:
    """Make the CPU backend's gloo collectives listen on ``interface`` (or ``hostname``).

    By default gloo advertises the address the machine's hostname resolves to, which is
    loopback on many containers and cluster nodes. jax's public config has no option for
    it; ``jax._src.lib._jax.make_gloo_tcp_collectives`` takes one, so the CPU backend's
    factory (private ``jax._src.xla_bridge``) is re-registered to build its gloo
    collectives with it. Must run before the backend starts; it stays in force across
    ``clear_backends()`` (the rebuild after a rejoin uses the same factory).
    """
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    def make_cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(distributed_client=distributed.global_state.client,
                                                     hostname=hostname, interface=interface)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)



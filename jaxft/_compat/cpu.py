"""Borrowed CPU-backend internals: gloo's rendezvous keys and records, the address gloo listens
on, and the epoll registrations of gloo's event loop."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import re
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




# -- gloo's event loop ----------------------------------------------------------------------------

EPOLLIN, EPOLLONESHOT, EPOLLET = 0x1, 1 << 30, 1 << 31
_EPOLL_CTL_MOD = 3
# struct epoll_event: packed on x86-64 (12 bytes), naturally aligned elsewhere (16 bytes)
_EVENT = struct.Struct("=IQ" if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") else "@IQ")
_TFD = re.compile(r"tfd:\s*(\d+)\s+events:\s*([0-9a-fA-F]+)\s+data:\s*([0-9a-fA-F]+)"
                  r"\s+pos:\s*\d+\s+ino:\s*([0-9a-fA-F]+)")


@dataclasses.dataclass(frozen=True)
class Registration:
    """One descriptor that one of this process's epoll instances watches."""

    epoll: int  # the epoll instance's descriptor
    fd: int  # the descriptor it watches
    events: int  # the events it was registered for (the kernel adds EPOLLERR | EPOLLHUP)
    data: int  # the word its owner registered with it (gloo: the handler it calls)
    inode: int  # the inode of the watched file (a socket's: /proc/net/tcp's inode column)


def registrations_of(epoll: int) -> list[Registration]:
    """What the epoll instance ``epoll`` (a descriptor of this process) watches (see
    :func:`epoll_registrations`)."""
    try:
        with open(f"/proc/self/fdinfo/{epoll}") as f:
            text = f.read()
    except OSError:
        return []
    return [Registration(epoll, int(fd), int(ev, 16), int(data, 16), int(ino, 16))
            for fd, ev, data, ino in _TFD.findall(text)]


def epoll_registrations() -> list[Registration]:
    """Every descriptor this process's epoll instances watch (Linux; empty elsewhere).

    Private in the sense of this shim: no API lists what gloo's event loop watches. Read from
    ``/proc/self/fdinfo`` of each ``anon_inode:[eventpoll]`` descriptor (the kernel's text:
    ``tfd: <fd> events: <hex> data: <hex> pos: <n> ino: <hex>``). jaxft reads it to find the
    connections gloo's loop keeps ready for ever (:mod:`jaxft.worker.deadpairs`);
    ``tests/test_private_api.py`` checks that gloo's listener and pairs are found there,
    registered level-triggered."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    out: list[Registration] = []
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[eventpoll]":
                continue
        except OSError:
            continue
        out += registrations_of(int(name))
    return out


def disarm(r: Registration) -> bool:
    """Stop ``r``'s epoll instance reporting ``r``'s descriptor: ``EPOLL_CTL_MOD`` to
    ``EPOLLIN | EPOLLONESHOT`` with its data word unchanged, so its owner's handler gets at most
    one more event, and none after (``EPOLLHUP`` and ``EPOLLERR`` included) until its owner
    modifies the registration again; the owner can still remove it. The registration is read
    again first: False, untouched, if it changed since ``r`` was read (say the descriptor was
    closed and reused), or if the call failed."""
    if r not in registrations_of(r.epoll):
        return False
    event = ctypes.create_string_buffer(_EVENT.pack(EPOLLIN | EPOLLONESHOT, r.data), _EVENT.size)
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.epoll_ctl(r.epoll, _EPOLL_CTL_MOD, r.fd, event) == 0

"""Every private jax / jaxlib name jaxft borrows, in one place.

jaxft needs a few things upstream has no public API for yet. Each function here says
why it is needed and what would replace it. The supported jax range is pinned in
``pyproject.toml``; ``tests/test_private_api.py`` checks the *behaviour* of each one
(not only that the name exists), so a release that moves one fails loudly there.
(Orbax internals live in :mod:`jaxft.checkpoint.orbax`, the only module touching them.)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

from jaxft.errors import InitializeError

# -- the backend ------------------------------------------------------------------------------

def backend_started() -> bool:
    """Whether a JAX backend is up (XLA reads its flags once, so initialize() must come first).

    Private: ``jax._src.xla_bridge.backends_are_initialized``. No public equivalent.
    """
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


# -- jax.distributed --------------------------------------------------------------------------

def distributed_client_or_none() -> Any:
    """The ``jax.distributed`` client, or None before initialize.

    Private: ``jax._src.distributed.global_state.client``. jaxft needs the client's
    key-value store, barriers and ``get_live_nodes``; upstream exposes them only there.
    """
    from jax._src import distributed

    return distributed.global_state.client


def distributed_client() -> Any:
    """The live ``jax.distributed`` client; :class:`InitializeError` before initialize."""
    client = distributed_client_or_none()
    if client is None:
        raise InitializeError("jax.distributed is not initialized; call jaxft.initialize() first")
    return client


@contextlib.contextmanager
def no_service_start() -> Iterator[None]:
    """Stop ``jax.distributed.initialize`` from starting a service in process 0.

    jax starts the coordination service inside process 0 unconditionally; with an external
    coordinator that second service would be wrong (and process 0 special again). The
    factory jax's distributed module calls (private ``jax._src.distributed._jax``) is
    swapped for a stub while it runs. Replace with an ``initialize(start_service=False)``
    option once jax has one.
    """
    from jax._src import distributed

    real = distributed._jax

    class _NoService:
        def shutdown(self) -> None:
            pass

    class _Proxy:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def get_distributed_runtime_service(*args, **kwargs):
            return _NoService()

    distributed._jax = _Proxy()
    try:
        yield
    finally:
        distributed._jax = real
        if isinstance(distributed.global_state.service, _NoService):
            distributed.global_state.service = None


def start_service(address: str, num_processes: int, *, heartbeat_timeout: int, shutdown_timeout: int) -> Any:
    """A recoverable coordination service in this process (``.shutdown()`` ends it).

    Private: ``jax._src.lib._jax.get_distributed_runtime_service``, the factory
    ``jax.distributed.initialize`` uses in process 0. A service of its own process is
    what makes process 0 expendable; jax has no public way to run one.
    """
    from jax._src.lib import _jax

    return _jax.get_distributed_runtime_service(address, num_processes, heartbeat_timeout=int(heartbeat_timeout),
                                                shutdown_timeout=int(shutdown_timeout), recoverable=True)


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


def delete_global_topology_key(client: Any) -> None:
    """Process 0 rewrites the global topology when its backend starts (see above)."""
    client.key_value_delete(GLOBAL_TOPOLOGY_KEY)


# -- live_devices' remembered state ------------------------------------------------------------

def live_device_map() -> Mapping[Any, int]:
    """``live_devices``' remembered ``{device: incarnation}`` of its last block.

    Private state of ``jax.experimental.multihost_utils.live_devices`` (``.devices``):
    the public context manager yields devices, not the incarnations jaxft's rejoin
    detection needs. Replace with an API returning incarnations.
    """
    from jax.experimental import multihost_utils

    return multihost_utils.live_devices.devices or {}


def rekey_live_devices(current_devices: list) -> None:
    """Point ``live_devices``' remembered map at the current backend's device objects.

    After ``clear_backends()`` the device objects are new; without this the next
    ``live_devices`` block raises ``ProcessFailureError`` for devices that are fine.
    Writes the private ``live_devices.devices``.
    """
    from jax.experimental import multihost_utils

    live = multihost_utils.live_devices
    if not live.devices:
        return
    by_id = {d.id: d for d in current_devices}
    if all(by_id.get(d.id) is d for d in live.devices):
        return
    live.devices = {by_id[d.id]: inc for d, inc in live.devices.items() if d.id in by_id}

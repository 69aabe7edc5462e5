"""Borrowed ``jax.distributed`` internals: the client, the service, live_devices' state, cluster detection."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from jaxft.errors import InitializeError

logger = logging.getLogger(__name__)


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


def create_key(client: Any, key: str, value: str) -> bool:
    """Create ``key`` = ``value`` in the key-value store unless it exists; whether this call did.

    ``key_value_set(..., allow_overwrite=False)`` is the service's first-writer-wins insert:
    of concurrent callers exactly one creates the key, so every caller then reads one value.
    A key that exists raises ``JaxRuntimeError`` whose status (the message's first word) is
    ``ALREADY_EXISTS``; neither a typed error nor a return value says so (no API). Every
    other error (the service unreachable) propagates.
    """
    try:
        client.key_value_set(key, value, allow_overwrite=False)
    except Exception as e:
        if str(e).lstrip().startswith("ALREADY_EXISTS"):
            return False
        raise
    return True


def client_factory() -> Any:
    """``jax._src.lib._jax.get_distributed_runtime_client`` (private: see :func:`retire_life`)."""
    from jax._src.lib import _jax

    return _jax.get_distributed_runtime_client


def retire_life(address: str, process_id: int, timeout_s: float = 2.0,
                then: Callable[[Any], Any] | None = None) -> None:
    """Give ``process_id`` a new incarnation in the coordination service at ``address``, at once.

    A process the launcher saw exit is dead, but the service counts it alive until its
    heartbeat times out, and a liveness query that it entered before dying can still
    complete with it in the answer, unchanged. Members that left such a query on the
    launcher's word and asked again without it would then disagree with a member that came
    late to it (one commits the step, the others do not). Registering a new incarnation of
    the dead process (a client that connects as it, then shuts down) makes every later
    answer name that new incarnation: whoever gets one sees the dead life gone. The new
    incarnation sends no heartbeat and is declared dead in turn, or replaced by the real
    restart when that connects. ``then(client)``, if given, runs as that new incarnation
    before it shuts down.

    A jax client that meets an error terminates its process: :mod:`jaxft.supervisor.retire` calls this
    in a helper process of the launcher, never in the launcher itself.

    Private: ``jax._src.lib._jax.get_distributed_runtime_client`` (:func:`client_factory`), the
    client factory behind ``jax.distributed.initialize``; no public way to act for another
    process exists.
    """
    client = client_factory()(address, int(process_id), init_timeout=max(1, int(timeout_s)),
                              heartbeat_timeout=max(1, int(timeout_s)), shutdown_on_destruction=False)
    client.connect()
    try:
        if then is not None:  # (acts as the new incarnation: jaxft.supervisor.retire.record_retired)
            then(client)
    finally:
        _shut(client, process_id)


def _shut(client: Any, process_id: int) -> None:
    """Shut the retiring client down; its failure changes nothing (the incarnation is registered)."""
    try:
        client.shutdown()
    except Exception as e:  # noqa: BLE001 - the new incarnation is registered: that is what counts
        logger.debug("retiring process %d's life: shutdown: %s", process_id, e)


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


# -- cluster detection -------------------------------------------------------------------------

def detect_cluster(initialization_timeout: int) -> tuple[str, str | None, int | None, int | None,
                                                         list[int] | None] | None:
    """``(name, coordinator_address, num_processes, process_id, local_device_ids)`` of the
    cluster jax's own detection finds (SLURM, Open MPI, Kubernetes, Cloud TPU), else None.

    Private: ``jax._src.clusters.ClusterEnv`` and its registered subclasses, the code behind
    ``jax.distributed.initialize()``'s auto-detection. jaxft needs the values (and which
    cluster gave them) before it connects, to host or not host the service and to report
    ``Runtime.source``; the public call offers no way to ask. Opt-in methods (mpi4py) are
    skipped, as jax does by default. ``JAX_COORDINATOR_PORT`` is honoured, as in jax.
    """
    import os

    from jax._src import clusters

    env = next((e for e in clusters.ClusterEnv._cluster_types
                if not e.opt_in_only_method and e.is_env_present()), None)
    if env is None:
        return None
    address = env.get_coordinator_address(timeout_secs=initialization_timeout,
                                          override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT"))
    local = env.get_local_process_id()
    return (env.name, address, env.get_process_count(), env.get_process_id(),
            None if local is None else [int(local)])



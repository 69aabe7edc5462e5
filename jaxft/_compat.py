"""Every private jax / jaxlib name jaxft borrows, in one place.

jaxft needs a few things upstream has no public API for yet. Each function here says
why it is needed and what would replace it. The supported jax range is pinned in
``pyproject.toml``; ``tests/test_private_api.py`` checks the *behaviour* of each one
(not only that the name exists), so a release that moves one fails loudly there.
(Orbax internals live in :mod:`jaxft.worker.checkpoint.orbax`, the only module touching them.)
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
from collections.abc import Iterator, Mapping, Sequence
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


def retire_life(address: str, process_id: int, timeout_s: float = 2.0) -> None:
    """Give ``process_id`` a new incarnation in the coordination service at ``address``, at once.

    A process the launcher saw exit is dead, but the service counts it alive until its
    heartbeat times out, and a liveness query that it entered before dying can still
    complete with it in the answer, unchanged. Members that left such a query on the
    launcher's word and asked again without it would then disagree with a member that came
    late to it (one commits the step, the others do not). Registering a new incarnation of
    the dead process (a client that connects as it, then shuts down) makes every later
    answer name that new incarnation: whoever gets one sees the dead life gone. The new
    incarnation sends no heartbeat and is declared dead in turn, or replaced by the real
    restart when that connects.

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
        client.shutdown()
    except Exception as e:  # noqa: BLE001 - the new incarnation is registered: that is what counts
        logger.debug("retiring process %d's life: shutdown: %s", process_id, e)


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


# -- the persistent compilation cache across processes -------------------------------------------

def share_cpu_cache_entries() -> None:
    """Give a multi-process CPU executable the same persistent-cache key in every process.

    jax keys a cache entry partly by the topology of the devices it runs on
    (``jax._src.cache_key._hash_accelerator_config``); a CPU topology's fingerprint differs
    from process to process (it describes the caller's own devices), and only process 0
    writes entries. So processes other than 0, a restarted process included, never found
    an entry and recompiled every mesh (~2 s per width change here). On CPU, hash the device
    kinds instead (what jax does for backends without a topology): the program, the device
    assignment (in the compile options) and the flags still key the entry, and an
    executable compiled by process 0 loads in every process (jax's own
    ``jax_share_binary_between_hosts`` relies on the same). Idempotent; other platforms are
    untouched.
    """
    import numpy as np
    from jax._src import cache_key

    original = cache_key._hash_accelerator_config
    if getattr(original, "_jaxft_cpu_shared", False):
        return

    def hash_accelerator_config(hash_obj, accelerators, *args, **kwargs):
        devices = list(np.asarray(accelerators).flat)
        if devices and all(getattr(d, "platform", None) == "cpu" for d in devices):
            cache_key._hash_devices(hash_obj, np.asarray(accelerators))
            return None
        return original(hash_obj, accelerators, *args, **kwargs)

    hash_accelerator_config._jaxft_cpu_shared = True  # type: ignore[attr-defined]
    cache_key._hash_accelerator_config = hash_accelerator_config


def cache_local_executables() -> None:
    """Let every process write the persistent-cache entries of programs that run on its own
    devices only.

    jax writes cache entries from process 0 alone (``compiler._cache_write``: many writers of
    one key contend on shared filesystems). That is right for a multi-process executable
    (every process has the same key, and :func:`share_cpu_cache_entries` makes process 0's
    entry serve them all), but a program on one process's own devices (a model's ``init``,
    a host-side helper) has a key of its own per process (its device assignment): no
    process but 0 ever found one, and each restarted process compiled them again (measured,
    flax CNN ``init``, 2 processes, second run: process 0 0.66 s, process 1 4.2 s; in the main
    job a cold restart waited ~7 s for processes 1-3 while process 0 had restored). Such
    entries are now written by their process (one writer per key: no contention); every
    other entry is left to jax. Idempotent.

    Private: ``jax._src.compiler.compile_or_get_cached`` (wrapped to see the devices) and
    ``_cache_write`` (replaced for such programs by ``compilation_cache.put_executable_and_time``,
    under jax's own callback and compile-time rules). Upstream could key the process-0 rule
    on whether the executable spans processes.
    """
    import threading

    import jax
    import numpy as np
    from jax._src import compilation_cache, compiler, distributed

    if getattr(compiler._cache_write, "_jaxft_local", False):
        return
    original_compile, original_write = compiler.compile_or_get_cached, compiler._cache_write
    local = threading.local()

    def compile_or_get_cached(backend, computation, devices, *args, **kwargs):
        me = distributed.global_state.process_id
        before = getattr(local, "own", False)
        local.own = bool(me) and all(d.process_index == me for d in np.asarray(devices).flat)
        try:
            return original_compile(backend, computation, devices, *args, **kwargs)
        finally:
            local.own = before

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, *rest, **kwargs):
        if not getattr(local, "own", False):
            return original_write(cache_key, compile_time_secs, module_name, backend, executable, *rest, **kwargs)
        host_callbacks = rest[0] if rest else kwargs.get("host_callbacks", ())
        if host_callbacks or compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
            return None  # (jax's own rules: callbacks are baked into the program; too quick to keep)
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as e:  # noqa: BLE001 - a cache is an optimisation, as in jax
            logger.warning("could not write the persistent cache entry of %r: %s", module_name, e)
        return None

    compile_or_get_cached._jaxft_local = True  # type: ignore[attr-defined]
    cache_write._jaxft_local = True  # type: ignore[attr-defined]
    compiler.compile_or_get_cached, compiler._cache_write = compile_or_get_cached, cache_write


# -- compiled programs across backends ----------------------------------------------------------

def serialize_compiled(compiled: Any) -> tuple:
    """``(bytes, in_tree, out_tree)`` of a ``jax.stages.Compiled``, loadable into a later backend.

    ``jax.experimental.serialize_executable`` (experimental: no stability promise; it reads
    the executable's private ``_unloaded_executable``). Devices are stored by id, so the bytes
    load into the backend a CPU rebuild makes, whose devices have the same ids.
    """
    from jax.experimental import serialize_executable

    return serialize_executable.serialize(compiled)


def load_compiled(blob: tuple, devices: Sequence[Any], compiled_for: Sequence[int] | None = None) -> Any:
    """:func:`serialize_compiled`'s bytes loaded into the current backend, to run on ``devices``
    (the program's device assignment, in its order: a mesh's devices; jax's default, every
    device of the backend, is wrong for a program over a subset of them).

    ``compiled_for``: the ids of the devices the program was compiled for, when they are not
    ``devices``' (as many): the program is loaded for ``devices`` instead, its device
    assignment replaced. Sound only for a program that lowers to the same module for both
    device lists (the caller checks); jax does the same with its persistent cache on GPU,
    whose entries are keyed without the device assignment and loaded with the caller's.

    Private (that case only): ``jax.experimental.serialize_executable._JaxPjrtUnpickler``
    (its device table remapped: the pickled shardings name devices by id) and
    ``jax._src.compiler.get_compile_options`` (the options jax compiles a 1-D SPMD program
    with, given the new assignment, passed to ``Client.deserialize_executable`` as jax's
    persistent cache does). No public API loads an executable for other devices.
    """
    import jax
    from jax.experimental import serialize_executable

    devices = list(devices)
    client = jax.devices()[0].client
    if compiled_for is None or [d.id for d in devices] == list(compiled_for):
        return serialize_executable.deserialize_and_load(*blob, backend=client, execution_devices=devices)
    if len(compiled_for) != len(devices):
        raise ValueError(f"a program for {len(compiled_for)} devices cannot run on {len(devices)}")
    import io

    import numpy as np
    from jax._src import compiler

    options = compiler.get_compile_options(num_replicas=1, num_partitions=len(devices),
                                           device_assignment=np.array(devices, dtype=object).reshape(1, -1),
                                           backend=client)

    class Reassigning(serialize_executable._JaxPjrtUnpickler):
        def __init__(self, file):
            super().__init__(file, client, devices)
            self.devices_by_id = dict(zip(compiled_for, devices))

        def persistent_load(self, pid):
            if pid[0] == "exec":
                return client.deserialize_executable(pid[1], executable_devices=self.execution_devices,
                                                     compile_options=options)
            return super().persistent_load(pid)

    serialized, in_tree, out_tree = blob
    unloaded, args_info_flat, no_kwargs = Reassigning(io.BytesIO(serialized)).load()
    return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info_flat), out_tree,
                               no_kwargs=no_kwargs)


_compile_hits = None  # a threading.local counting this thread's persistent-cache hits


def compile_fresh(lowered: Any) -> tuple[Any, bool]:
    """``lowered.compile()``, and whether the executable was compiled now rather than loaded from
    jax's persistent compilation cache.

    jaxft serializes only what was compiled now: a CPU executable loaded from the persistent
    cache and serialized again loses its kernels (measured on jax 0.10.2: the reloaded program
    fails with ``NOT_FOUND: Function ..._fusion not found``). The hit is seen through jax's
    monitoring event ``/jax/compilation_cache/cache_hits`` (public listener API, event name not
    documented), counted per thread because the warm-up thread compiles too.
    """
    global _compile_hits
    import threading

    import jax

    if _compile_hits is None:
        _compile_hits = threading.local()

        def on_event(name: str, **_: Any) -> None:
            if name == "/jax/compilation_cache/cache_hits":
                _compile_hits.n = getattr(_compile_hits, "n", 0) + 1

        jax.monitoring.register_event_listener(on_event)
    before = getattr(_compile_hits, "n", 0)
    compiled = lowered.compile()
    return compiled, getattr(_compile_hits, "n", 0) == before

"""``jaxft.initialize``: multi-controller JAX set up to survive process failures."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import logging
import math
import os
import shlex
import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from jaxft import _compat, protocol
from jaxft import timeouts as timeouts_lib
from jaxft.errors import InitializeError, TimeoutsError
from jaxft.events import EventLog
from jaxft.faults import FaultInjector, FaultRule
from jaxft.net import interface_problem, wait_reachable
from jaxft.protocol import Event
from jaxft.timeouts import Timeouts
from jaxft.worker import breaker, cluster, exits
from jaxft.worker.options import InitOptions

# From the JAX fault-tolerance guide: NCCL errors must not terminate the process, and
# collectives must be abortable when a participant dies (GPU only; ignored on CPU).
GPU_XLA_FLAGS = {
    "xla_gpu_nccl_terminate_on_error": "false",
    "xla_gpu_nccl_async_execution": "true",
    "xla_gpu_nccl_blocking_communicators": "false",
}
GPU_ENV = {
    "XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE": "1",
    "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1",
}
CPU_COLLECTIVE_TIMEOUT_FLAG = "xla_cpu_collective_timeout_seconds"


logger = logging.getLogger(__name__)

_LOCAL_COORDINATOR = None  # the private service of a single-process run


@dataclasses.dataclass
class Runtime:
    """What a worker knows about itself after :func:`initialize`."""

    placement: cluster.Placement  # who it is in which job (resolved: no field left None but the devices)
    incarnation: int
    run_dir: str | None
    events: EventLog
    faults: FaultInjector
    timeouts: Timeouts = dataclasses.field(default_factory=Timeouts)

    @property
    def process_id(self) -> int:
        return int(self.placement.process_id or 0)

    @property
    def num_processes(self) -> int:
        return int(self.placement.num_processes or 1)

    @property
    def coordinator_address(self) -> str:
        return str(self.placement.coordinator_address)

    @property
    def external_coordinator(self) -> bool:
        return bool(self.placement.external_coordinator)

    @property
    def source(self) -> str:
        """Where the settings came from: see :data:`jaxft.worker.cluster.SOURCES`."""
        return self.placement.source

    @property
    def heartbeat_timeout(self) -> int:
        return int(self.timeouts.heartbeat)

    @property
    def collective_timeout(self) -> int:
        return int(self.timeouts.collective)


def merge_xla_flags(existing: str, wanted: dict[str, str]) -> str:
    """Add ``--name=value`` for each wanted flag the user has not set already.

    The user's own settings win: a flag already present in ``existing`` is kept as is.
    """
    tokens = shlex.split(existing or "")
    present = {t.lstrip("-").split("=", 1)[0] for t in tokens if t.startswith("--")}
    added = [f"--{k}={v}" for k, v in wanted.items() if k not in present]
    return " ".join(filter(None, [(existing or "").strip(), *added]))  # the user's text verbatim


def configure_environment(collective_timeout: int, environ=os.environ) -> None:
    """Set XLA flags and env vars for recoverable collectives (before the backend starts)."""
    wanted = dict(GPU_XLA_FLAGS)
    wanted[CPU_COLLECTIVE_TIMEOUT_FLAG] = str(int(collective_timeout))
    environ["XLA_FLAGS"] = merge_xla_flags(environ.get("XLA_FLAGS", ""), wanted)
    for key, value in GPU_ENV.items():
        environ.setdefault(key, value)


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None,
               local_device_ids: Sequence[int] | None = None,
               *,
               timeouts: Timeouts | None = None,
               options: InitOptions = InitOptions(),
               environ: MutableMapping[str, str] = os.environ) -> Runtime:
    """Initialize multi-controller JAX so that processes can fail and come back.

    Wraps ``jax.distributed.initialize``: turns on ``jax_enable_recoverability``, merges
    the GPU NCCL-abort flags and the CPU collective timeout into ``XLA_FLAGS`` (flags the
    user already set win), sets the GPU abort env vars, and connects to the coordination
    service with a short heartbeat so dead peers are noticed in seconds.

    Arguments left as None are read from the environment ``jaxft launch`` sets
    (``JAXFT_COORDINATOR_ADDRESS``, ``JAXFT_PROCESS_ID``, ``JAXFT_TIMEOUTS``, ...), then from
    ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` /
    ``JAX_LOCAL_DEVICE_IDS``, then from the cluster jax detects (SLURM, Open MPI,
    Kubernetes, Cloud TPU); :attr:`Runtime.source` says which. An environment that half
    describes a cluster is an :class:`InitializeError`, never a silent single-process run.
    In a cluster without an external coordinator, process 0 hosts the service as in plain
    JAX (its death then ends the job; run ``jaxft coordinator`` as its own job step and set
    ``JAXFT_COORDINATOR_ADDRESS`` to avoid that).

    ``options.gloo_interface`` (or ``JAXFT_GLOO_INTERFACE``) names the network interface CPU
    collectives use; needed where this host's name resolves to loopback.
    ``timeouts`` sets every bound (:class:`~jaxft.Timeouts`; None: ``$JAXFT_TIMEOUTS``, else
    the defaults). It becomes this process's settings (:func:`jaxft.timeouts.current`), read
    by every later wait.

    With ``options.external_coordinator=True`` (what ``jaxft launch`` and ``jaxft coordinator``
    provide) no worker starts the service, so any worker, process 0 included, can die
    without taking the others with it. With ``False`` it behaves
    like plain ``jax.distributed.initialize``: process 0 hosts the service, and its death
    ends the job.

    Called with nothing set (no arguments, no launcher environment, no cluster) it runs as
    a single process with a private coordination service, so the same program works
    without ``jaxft launch``.

    With ``options.wait_until_forgotten`` (default; what ready admission, the default of
    ``ElasticLoop`` and ``ElasticTrainer``, needs), a restarted process connects only once the
    service has declared its previous incarnation dead, so the survivors never wait for its
    set-up (``jaxft launch`` says when it died; without that, no wait). ``False`` connects at
    once: for ``ElasticGroup(admission="connect")``, where the members wait for a restarted
    process anyway.

    ``options.compilation_cache``: a directory for jax's persistent compilation cache shared by the
    run's processes (a joiner, a restarted process and survivors returning to a width they
    ran before load executables instead of compiling them, CPU executables included;
    measured: docs/benchmarks.md, 'Figures behind the code'); None (default) uses
    ``$JAXFT_COMPILATION_CACHE`` (one directory across runs: a relaunch or another run of the
    same model loads what an earlier one compiled), else ``<run_dir>/xla_cache`` when there is a
    run directory and the user set no cache of their own; False turns it off.

    Must be called before anything starts a JAX backend (``jax.devices()``, any
    computation): XLA reads its flags only once.

    With several processes it ends with ``gc.freeze()``: what exists then (mostly the
    imports) is left out of every later garbage collection, so that the full collection after
    each CPU backend rebuild stays cheap (:mod:`jaxft.worker.dataplane`); garbage in reference
    cycles made before the call is never reclaimed.

    Returns:
      A :class:`Runtime` with this worker's identity, event log and fault injector.
    """
    import jax

    if _compat.backend_started():
        raise InitializeError(
            "jaxft.initialize() must run before JAX starts its backend, but a backend is "
            "already up (something called jax.devices() or ran a computation first). "
            "Call jaxft.initialize() at the top of your program, before any other JAX use.")
    if _compat.distributed_client_or_none() is not None:
        raise InitializeError("jax.distributed is already initialized; call jaxft.initialize() once, "
                              "instead of jax.distributed.initialize().")

    try:
        timeouts = timeouts if timeouts is not None else Timeouts.from_env(environ)
    except TimeoutsError as e:
        raise InitializeError(str(e)) from None
    heartbeat_timeout, collective_timeout = int(timeouts.heartbeat), int(timeouts.collective)
    initialization_timeout = timeouts.initialization
    run_dir = options.run_dir or environ.get(protocol.RUN_DIR) or None
    incarnation = cluster.parse_env(environ.get(protocol.INCARNATION), protocol.INCARNATION, int) or 0
    place = cluster.resolve(coordinator_address, num_processes, process_id, local_device_ids,
                            options.external_coordinator, initialization_timeout, environ)
    if place.single_process:
        # Plain single-process run (no launcher, no cluster): host a private one-process
        # service so the same elastic code runs unchanged.
        global _LOCAL_COORDINATOR
        from jaxft.coordinator import Coordinator

        _LOCAL_COORDINATOR = Coordinator(1, heartbeat_timeout=heartbeat_timeout)
        place = dataclasses.replace(place, coordinator_address=_LOCAL_COORDINATOR.address)
    coordinator_address, external_coordinator = str(place.coordinator_address), place.external_coordinator
    num_processes, process_id = int(place.num_processes or 0), int(place.process_id or 0)
    local_device_ids = place.local_device_ids
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit():
        raise InitializeError(f"coordinator address {coordinator_address!r} is not host:port")
    if num_processes < 1:
        raise InitializeError(f"num_processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise InitializeError(f"process_id must be in [0, {num_processes}), got {process_id}")

    gloo_interface = options.gloo_interface or environ.get(protocol.GLOO_INTERFACE) or None
    gloo_hostname = environ.get(protocol.GLOO_HOSTNAME) or None
    if gloo_interface is None and gloo_hostname is None:
        cluster.check_gloo_reachable(coordinator_address, num_processes, environ)
    elif gloo_interface is not None and (problem := interface_problem(gloo_interface)):
        raise InitializeError(f"gloo_interface: {problem}")

    configure_environment(collective_timeout, environ)
    _configure_compilation_cache(options.compilation_cache, run_dir, environ)
    jax.config.update("jax_enable_recoverability", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A peer that dies while the CPU backends exchange topologies would otherwise leave
    # the others waiting 2 + 5 minutes; bound both by Timeouts.topology (minutes are the unit).
    topology_minutes = max(1, math.ceil(timeouts.topology / 60))
    jax.config.update("jax_cpu_get_local_topology_timeout_minutes", max(1, topology_minutes // 2))
    jax.config.update("jax_cpu_get_global_topology_timeout_minutes", topology_minutes)

    kwargs: dict[str, Any] = dict(coordinator_address=coordinator_address, num_processes=num_processes,
                  process_id=process_id, heartbeat_timeout_seconds=int(heartbeat_timeout),
                  initialization_timeout=max(1, int(initialization_timeout)))
    if local_device_ids is not None:
        kwargs["local_device_ids"] = list(local_device_ids)
    if external_coordinator or process_id != 0:
        # jax's client aborts the whole process (SIGABRT) when registration times out; find an
        # unreachable coordinator ourselves and say so.
        _wait_reachable(coordinator_address, initialization_timeout, process_id)
    if gloo_interface is not None or gloo_hostname is not None:
        _compat.use_gloo_address(interface=gloo_interface, hostname=gloo_hostname)
    waited = 0.0
    if options.wait_until_forgotten and protocol.peers_may_run(environ) is not False:  # False: no member to hold up
        waited = _wait_until_forgotten(environ, heartbeat_timeout, process_id)
    guard = _compat.no_service_start() if external_coordinator else contextlib.nullcontext()
    try:
        with guard:
            jax.distributed.initialize(**kwargs)
    except Exception as e:  # jax raises XlaRuntimeError / ValueError with terse texts
        raise InitializeError(
            f"could not connect process {process_id} to the coordination service at "
            f"{coordinator_address} within {timeouts.describe('initialization')}: {e}") from e

    breaker.protect(coordinator_address)  # the data-plane breaker never touches the service's connections
    # its launcher may retire this life in the service once it dies (jaxft.supervisor.retire)
    protocol.mark_life(protocol.CONNECTED, "this life's connection (its death is then noticed by heartbeat only)")
    if external_coordinator:
        _clear_stale_topology(process_id)
    elif num_processes > 1 and process_id == 0:  # it hosts the service: it must leave last
        atexit.register(exits.outlive_peers(num_processes, timeouts))
    elif num_processes > 1:
        atexit.register(exits.announce_leaving, process_id)
    events = EventLog(run_dir, process_id, incarnation)
    events.log(Event.INITIALIZED, source=place.source, forget_wait_s=round(waited, 3))
    faults = FaultInjector.from_env(process_id, on_fire=_fault_logger(events), environ=environ)
    timeouts_lib.set_current(timeouts)
    exits.install_stop_handlers()
    if num_processes > 1:
        # Out of every later collection (the imports, the connection; no backend exists yet):
        # a full collection after each CPU backend rebuild then stays cheap (jaxft.worker.dataplane).
        # Garbage in reference cycles made before now is never reclaimed (no collection first:
        # ~0.05 s over the ~110,000 objects of the imports, at every start).
        gc.freeze()
    return Runtime(placement=place, incarnation=incarnation, run_dir=run_dir, events=events, faults=faults,
                   timeouts=timeouts)


def _clear_stale_topology(process_id: int) -> None:
    """Process 0's CPU backend writes the global topology once; a restarted process 0 would
    fail with ALREADY_EXISTS on the old incarnation's copy (the topology cannot change)."""
    if process_id == 0:
        _compat.delete_global_topology_key(_compat.distributed_client())


def _configure_compilation_cache(setting: str | bool | None, run_dir: str | None, environ) -> None:
    """Point jax's persistent compilation cache at a directory the run's processes share."""
    import jax

    shared = environ.get(protocol.COMPILATION_CACHE) or None
    if setting is False or (setting is None and not shared and (
            not run_dir or environ.get("JAX_COMPILATION_CACHE_DIR")
            or jax.config.jax_compilation_cache_dir)):  # type: ignore[attr-defined]
        return
    path = setting if isinstance(setting, str) else shared or os.path.join(str(run_dir), "xla_cache")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # small CPU steps too
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _compat.share_cpu_cache_entries()  # else only process 0 ever finds a multi-process entry
    _compat.cache_local_executables()  # else only process 0 ever finds one of its own programs


def _wait_until_forgotten(environ: Mapping[str, str], heartbeat_timeout: float, process_id: int) -> float:
    """A restarted process connects only once no member can count it in a liveness query
    before it is ready; returns the seconds it waited.

    A new incarnation that registers while a member is still in a query over a set with its
    process (a member late to the step its previous life died in) is counted in that query,
    so the member waits for it through all of its set-up, and the others wait for the member.
    ``jaxft launch`` retires the dead life in the service at once and says when it died
    (:data:`jaxft.protocol.DIED_AT`); on one node it also names the members that were alive
    then (:data:`jaxft.protocol.DROP_WITNESSES`), and the restart connects as soon as each
    has dropped the dead life from its view (:func:`jaxft.protocol.restart_may_connect`), but
    not before ``protocol.RESTART_GAP_S``. Without witnesses (other nodes, a member still
    setting up, a retirement that failed) it waits until the service has declared the
    previous life dead: the heartbeat timeout, checked once a second, + 1.5 s.
    """
    died_at = cluster.parse_env(environ.get(protocol.DIED_AT), protocol.DIED_AT, float)
    if died_at is None:
        return 0.0
    start = time.time()
    deadline = min(died_at + heartbeat_timeout + 1.5, start + heartbeat_timeout + 1.5)
    earliest = died_at + protocol.RESTART_GAP_S
    witnesses = cluster.parse_env(environ.get(protocol.DROP_WITNESSES), protocol.DROP_WITNESSES, cluster.parse_ids)
    state_dir = environ.get(protocol.FAULT_STATE_DIR)
    if deadline <= start:
        return 0.0
    early = bool(witnesses and state_dir)
    logger.info("process %d: waiting up to %.1f s for %s", process_id, deadline - start,
                "the members to drop its previous incarnation" if early
                else "the service to forget its previous incarnation")
    if not early:
        time.sleep(deadline - start)
        return deadline - start
    while time.time() < deadline:
        if time.time() >= earliest and protocol.restart_may_connect(str(state_dir), process_id, died_at, witnesses):
            break
        time.sleep(0.01)
    return time.time() - start


def _wait_reachable(address: str, timeout: float, process_id: int) -> None:
    """Return once a TCP connection to ``address`` succeeds; InitializeError after ``timeout``."""
    why = wait_reachable(address, timeout)
    if why is not None:
        raise InitializeError(f"could not connect process {process_id} to the coordination service at "
                              f"{address} within {timeout:g} s ({why}); is the coordinator "
                              "(jaxft launch / jaxft coordinator) running?")


def _fault_logger(events: EventLog):
    def on_fire(rule: FaultRule, step: int) -> None:
        events.log(Event.FAULT, action=rule.action, step=step, phase=rule.phase, spec=rule.spec)

    return on_fire

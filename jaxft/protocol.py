"""The contract between the supervisor (``jaxft launch``) and its workers, in one place.

The two programs share nothing else: the launcher (:mod:`jaxft.supervisor`) never imports the
worker's code, nor jax, and the worker (:mod:`jaxft.worker`) never imports the launcher's. What
crosses between them:

* **environment variables** the launcher hands each worker (below);
* **files in the state dir** they share (``JAXFT_FAULT_STATE_DIR``): marks one life leaves for
  its launcher (it connected, it committed a step), and the deaths the launcher records for
  the members (:func:`record_death`); fault markers live beside them (:mod:`jaxft.faults`);
* **exit codes** with a meaning of their own (``EXIT_*``);
* **a life's record in the coordination service** (:data:`LIFE_PREFIX`), which the launcher's
  retire helper overwrites for a dead life (:func:`life_record`);
* **events** the workers and the launcher log to the run's ``events.jsonl`` (:class:`Event`), which
  the console, ``jaxft report`` and the goodput table read.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Collection, Mapping

logger = logging.getLogger(__name__)

# -- environment variables (launcher -> worker) -------------------------------------------------

COORDINATOR = "JAXFT_COORDINATOR_ADDRESS"  # host:port of the coordination service
EXTERNAL_COORDINATOR = "JAXFT_EXTERNAL_COORDINATOR"  # "1": no worker hosts the service
PROCESS_ID = "JAXFT_PROCESS_ID"
NUM_PROCESSES = "JAXFT_NUM_PROCESSES"
LOCAL_DEVICE_IDS = "JAXFT_LOCAL_DEVICE_IDS"  # comma separated, e.g. "0" or "2,3"
HEARTBEAT_TIMEOUT = "JAXFT_HEARTBEAT_TIMEOUT"  # seconds
COLLECTIVE_TIMEOUT = "JAXFT_COLLECTIVE_TIMEOUT"  # seconds, CPU collectives
INCARNATION = "JAXFT_INCARNATION"  # 0 for the first start, +1 per restart
DIED_AT = "JAXFT_PREVIOUS_DIED_AT"  # wall-clock time the launcher saw the previous incarnation exit
# A restart: "1" when a member may still run (a local worker whose life began before the death,
# or other nodes), "0" when every local worker is down or a restart of the same failure
PEERS_RUNNING = "JAXFT_PEERS_MAY_RUN"
# A restart: the local processes ("2,3") whose mark that they dropped its previous life lets it
# connect before the heartbeat timeout (see restart_may_connect); absent: wait the timeout out
DROP_WITNESSES = "JAXFT_DROP_WITNESSES"
# The processes ("4,9") that start as hot spares (jaxft launch --spares): a cold start's members
# are the others, and the run trains at their number (its width; see jaxft.core.spares)
SPARES = "JAXFT_SPARES"
RUN_DIR = "JAXFT_RUN_DIR"
# jax's persistent compilation cache for runs that set none of their own (InitOptions.compilation_cache):
# one directory shared across runs, where <run_dir>/xla_cache would start each run empty
COMPILATION_CACHE = "JAXFT_COMPILATION_CACHE"
FAULTS = "JAXFT_FAULTS"  # ";"-separated fault specs (see jaxft.faults)
FAULT_STATE_DIR = "JAXFT_FAULT_STATE_DIR"  # where "rule fired" markers live

TIMEOUTS = "JAXFT_TIMEOUTS"  # "name=seconds,..." (see jaxft.timeouts.Timeouts)
GLOO_INTERFACE = "JAXFT_GLOO_INTERFACE"  # network interface CPU collectives (gloo) use, e.g. "eth0"
GLOO_HOSTNAME = "JAXFT_GLOO_HOSTNAME"  # or the hostname/address gloo advertises
CHECKPOINT_ON_STOP = "JAXFT_CHECKPOINT_ON_STOP"  # "1": on SIGTERM, agree on a step, save, then exit
# Read by the launcher itself: "0" stops it from retiring a dead worker's life in the service
# (jaxft._compat.retire_life), as happens where it cannot (another node's agent died with it):
# for tests of the members' own guard, the step votes
RETIRE_LIVES = "JAXFT_RETIRE_LIVES"


def peers_may_run(environ: Mapping[str, str]) -> bool | None:
    """The launcher's word on a restart (:data:`PEERS_RUNNING`): a member may run on (True),
    none does (False), or nothing said (None: a first life, or no jaxft launch)."""
    return {"1": True, "0": False}.get(environ.get(PEERS_RUNNING, ""))


def spares(environ: Mapping[str, str]) -> frozenset[int]:
    """The processes that start as hot spares (:data:`SPARES`); empty without spares.
    Raises ValueError on a malformed value."""
    raw = environ.get(SPARES, "").strip()
    try:
        return frozenset(int(p) for p in raw.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"${SPARES} must list process ids like '4,9', got {raw!r}") from None
NODE_BEAT = "JAXFT_NODE_BEAT"  # a file the agent rewrites every second (``jaxft slurm`` watches it)
SLURM_REQUEUE = "JAXFT_SLURM_REQUEUE"  # a SLURM job id: an agent that lost the service for good requeues it
BASE_NICE = "JAXFT_BASE_NICE"  # the nice value a niced restart returns to when it joins (jaxft launch --nice-restarts)


# -- exit codes -----------------------------------------------------------------------------------

EXIT_STOPPED = 143  # asked to stop (SIGTERM), after a last checkpoint where one was asked for
EXIT_BARRIER_TIMEOUT = 75  # a worker that gave up waiting at a barrier (Timeouts.barrier): its peers held it up
EXIT_HUNG = 76  # a worker that found itself stuck and stopped (jaxft.worker.hang); its stack is in its output
EXIT_CONFIG_ERROR = 78  # a configuration error: restarting repeats it, so the launcher does not


# -- files in the state dir -----------------------------------------------------------------------

COMMITTED = "committed"  # a life's mark: it committed a step (the launcher's crash-loop guard)
CONNECTED = "connected"  # a life's mark: it connected to the service (the launcher may retire it)
DEATHS = "deaths"  # the launcher's death records: <process>-<incarnation> holds the time of death
DROPPED = "dropped"  # a member's marks: <process>.<member> holds when its view last dropped a life of <process>
# A restart connects at least this long after its previous life's death, so a death record older
# than a joiner's admission minus this is of an earlier life (jaxft.worker.joining)
RESTART_GAP_S = 1.0


def life_path(state_dir: str, kind: str, process_id: int | str, incarnation: int | str) -> str:
    """``<state dir>/<kind>/<process>-<incarnation>``: a mark, or a death record."""
    return os.path.join(state_dir, kind, f"{process_id}-{incarnation}")


def mark_life(kind: str, what: str, environ: Mapping[str, str] = os.environ) -> None:
    """Worker side: leave the empty mark ``kind`` for this life (``what`` names it in a warning
    if the file cannot be written); a no-op outside ``jaxft launch``."""
    state_dir, life, pid = environ.get(FAULT_STATE_DIR), environ.get(INCARNATION), environ.get(PROCESS_ID)
    if not state_dir or life is None or pid is None:
        return
    try:
        target = life_path(state_dir, kind, pid, life)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w"):
            pass
    except OSError as e:
        logger.warning("could not mark %s in %s: %s", what, state_dir, e)


def life_marked(state_dir: str, kind: str, process_id: int, incarnation: int) -> bool:
    """Launcher side: whether that life left the mark ``kind``."""
    return os.path.exists(life_path(state_dir, kind, process_id, incarnation))


def record_death(state_dir: str, process_id: int, incarnation: int) -> None:
    """Launcher side: record that ``process_id``'s launcher incarnation ``incarnation`` died now
    (written whole: a reader never sees an empty record)."""
    _write_time(os.path.join(state_dir, DEATHS), f"{process_id}-{incarnation}")


def death_recorded(state_dir: str, process_id: int, incarnation: int) -> bool:
    """Whether the launcher recorded the death of ``process_id``'s launcher incarnation ``incarnation``."""
    return os.path.exists(life_path(state_dir, DEATHS, process_id, incarnation))


def _write_time(d: str, name: str) -> None:
    """``<d>/<name>`` := the time now, written whole (a reader never sees an empty file)."""
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(f"{time.time():.6f}")
    os.replace(tmp, os.path.join(d, name))


def _read_time(path: str) -> float | None:
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def mark_dropped(process_id: int, environ: Mapping[str, str] = os.environ) -> None:
    """Worker side: this member's view of the run no longer holds the life ``process_id`` had
    (a liveness answer without it is final), so no query this member makes from now on can
    count that process's next life before it is admitted; a no-op outside ``jaxft launch``."""
    state_dir, me = environ.get(FAULT_STATE_DIR), environ.get(PROCESS_ID)
    if not state_dir or me is None:
        return
    try:
        _write_time(os.path.join(state_dir, DROPPED), f"{int(process_id)}.{me}")
    except OSError as e:
        logger.warning("could not mark process %s dropped in %s: %s", process_id, state_dir, e)


def restart_may_connect(state_dir: str, process_id: int, died_at: float, witnesses: Collection[int]) -> bool:
    """A restart's early connect: whether each of ``witnesses`` (the local processes alive when
    its previous life died at ``died_at``) has dropped that life since (:func:`mark_dropped`) or
    died itself since. Then no member is left in a liveness query that counts ``process_id``
    (the launcher retired the dead life at once), and the new life is never pulled into one
    before it is ready: connecting now is as safe as after the heartbeat timeout."""
    unmarked = [int(w) for w in witnesses
                if (_read_time(os.path.join(state_dir, DROPPED, f"{int(process_id)}.{int(w)}")) or 0.0) < died_at]
    if not unmarked:
        return True
    deaths = recorded_deaths(state_dir)  # (read only when a mark is missing: this is polled)
    return all(deaths.get(w, 0.0) >= died_at for w in unmarked)


def recorded_deaths(state_dir: str) -> dict[int, float]:
    """``{process: time of its latest recorded death}``."""
    out: dict[int, float] = {}
    d = os.path.join(state_dir, DEATHS)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return out
    for name in names:
        if name.startswith("."):
            continue
        p, t = name.split("-", 1)[0], _read_time(os.path.join(d, name))
        if p.isdigit() and t is not None:
            out[int(p)] = max(out.get(int(p), 0.0), t)
    return out


# -- a life's record in the coordination service (worker, and the launcher's retire helper) -------

LIFE_PREFIX = "jaxft/life/"  # jaxft/life/<process>: its newest life (jaxft.worker.lives)


def life_record(incarnation: int, nonce: str, launch: int | None, retired: bool = False) -> str:
    """The value of a life's record: its service incarnation, heartbeat nonce and launcher
    incarnation; ``retired``: written by the launcher's helper for a life it saw die, naming
    the new incarnation it gave the process (:mod:`jaxft.supervisor.retire`)."""
    value: dict[str, object] = {"incarnation": int(incarnation), "nonce": nonce, "launch": launch}
    if retired:
        value["retired"] = True
    return json.dumps(value)


# -- an agent's heartbeat (agent -> ``jaxft slurm``) --------------------------------------------------

BEAT_EXIT = "exit"  # an agent's last beat: "exit CODE", written before it exits


def write_beat(path: str, text: str) -> None:
    """Agent side: replace the heartbeat file ``path`` with ``text`` (whole: a reader never
    sees half of it). The watcher compares contents on its own clock, never file times, so a
    shared filesystem's clocks and attribute caches do not matter."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_beat(path: str) -> str | None:
    """Watcher side: the heartbeat file's text; None while there is none."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


# -- events ---------------------------------------------------------------------------------------

class Event:
    """The names of the events in ``events.jsonl`` (one JSON object a line, ``event`` = one of
    these), as every writer and reader spells them."""

    # the launcher
    RUN_START, RUN_END, LAUNCH, EXIT, RESTART = "run_start", "run_end", "launch", "exit", "restart"
    CRASH_LOOP, INTERRUPTED, RETIRE_FAILED = "crash_loop", "interrupted", "retire_failed"
    COORDINATOR_LOST, COORDINATOR_BACK, COORDINATOR_GONE = "coordinator_lost", "coordinator_back", "coordinator_gone"
    # jaxft slurm: a node's agent lost (no heartbeat), an agent started for a rank (first, spare, returned node)
    NODE_LOST, NODE_STARTED, JOB_REQUEUED = "node_lost", "node_started", "job_requeued"
    # both (a fault fired: by the launcher's clock, or at a worker's fault point)
    FAULT, HUNG = "fault", "hung"
    # a worker's life
    INITIALIZED, TRAIN_START, FINAL, STOPPED = "initialized", "train_start", "final", "stopped"
    RUN_ALREADY_FINISHED = "run_already_finished"
    # the step
    COMMIT, STEP_FAILED, STEP_WAITING = "commit", "step_failed", "step_waiting"
    ROLLED_BACK, DESYNC = "rolled_back", "desync"
    ABANDONED, ABANDONED_WITHOUT_FAILURE = "abandoned", "abandoned_without_failure"
    DATA_PLANE, BACKEND_LEAKED, PRECOMPILED = "data_plane", "backend_leaked", "precompiled"
    # admission and rejoin
    ADMIT, ADMISSION_HELD, JOIN, REHYDRATED = "admit", "admission_held", "join", "rehydrated"
    STATE_MISMATCH = "state_mismatch"
    # checkpoints
    CHECKPOINT_STARTED, CHECKPOINT_SAVED = "checkpoint_started", "checkpoint_saved"
    CHECKPOINT_ABANDONED, CHECKPOINT_REJECTED = "checkpoint_abandoned", "checkpoint_rejected"
    CHECKPOINT_DATA_MISMATCH = "checkpoint_data_mismatch"
    RESTORED, RESTORE_DEFERRED = "restored", "restore_deferred"
    # benchmarks
    BENCH_OVERHEAD, BENCH_REHYDRATE = "bench_overhead", "bench_rehydrate"
    BENCH_REHYDRATE_MEMORY = "bench_rehydrate_memory"

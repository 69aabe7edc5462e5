"""Orbax async checkpoints on the live set, and a cold restart when every process dies.

What it does
------------
* **Async saves that do not stall the step.** Every ``K`` steps (or on demand) the
  committed state is copied to host memory (the only cost the step loop pays, plus a
  few millisecond barriers) and handed to an Orbax ``CheckpointManager`` with async
  checkpointing; the write, the checksum and the publication run in the background.
* **Any live subset can save.** In data parallelism every live process holds a full
  replica, so a save needs only the processes that are alive. Each save uses a
  ``CheckpointManager`` built for the members of the commit it saves:
  ``MultiprocessingOptions(primary_host=min(live), active_processes=set(live))`` on a
  pre-created directory (``create=False``), with a barrier namespace unique to
  (members, their incarnations, step). So a manager is rebuilt whenever the member set
  changes, and barrier ids of a dead member set are never reused.
* **Every barrier is bounded or abandoned when a member dies.** All of them are scoped
  to the save's live processes (``active_processes``), so none falls back to
  ``sync_global_devices``. Orbax's blocking barriers (coordination-service barriers)
  get a bound of ``barrier_timeout_s`` instead of Orbax's 300 s. The barriers of the
  background phase go through :class:`_KVBarrier` (Orbax's
  ``AsyncOptions.barrier_sync_fn`` hook), a barrier on the coordination service's
  key-value store that gives up as soon as a missing member is known to be dead: the
  trainer committed a step without it, or its heartbeat stopped for ``dead_after_s``.
  (A coordination-service barrier waits its whole timeout for a dead process.) Step
  directories are created synchronously, so no Orbax "signal" crosses processes, and
  JAX's preemption sync point (which involves every process) is not consulted.
* **A save racing a failure never publishes a partial checkpoint.** Publication is
  Orbax's own: data is written into ``<step>.orbax-checkpoint-tmp``, and only after every
  member reached the "write complete" barrier does the primary write
  ``commit_success.txt`` and rename the directory to ``<step>``. A member dying before
  that barrier makes the save abandoned (the previous checkpoint stays the latest); a
  member dying after it cannot stop the primary from finishing on the remaining members.
* **Cold restore with validation.** A process starting restores the newest finalized
  checkpoint that reads back completely and whose SHA-256 (stored in Orbax's step
  metadata, ``custom_metadata``) matches; a checkpoint that fails is reported
  (``checkpoint_rejected``), moved to ``<dir>/rejected/`` so that the step can be saved
  again, and the previous one is tried. The state is replicated, so a run with a
  different number of processes restores the same checkpoint.

Replicated numpy arrays: Orbax's ``NumpyHandler`` writes them from process 0 only,
which would silently write nothing when process 0 is dead; :class:`_PrimaryNumpyHandler`
is the same handler (same on-disk format) writing from the save's primary host.

Checkpoint ``N`` is the state after ``N`` committed steps; the data position (``N *
global_batch`` of the ``GlobalBatches`` permutation) and the RNG are functions of ``N``
and the seeds recorded in the metadata.

Events: ``checkpoint_started`` (step, blocking_ms), ``checkpoint_saved`` (step, path,
blocking_ms, write_ms), ``checkpoint_abandoned`` (step, path, reason),
``checkpoint_rejected`` (path, step, reason), ``restored`` (step, path).

``python -m jaxft.checkpoint --bench`` compares the step loop's blocking time of an
async save with a synchronous save of the same ~100 MB state.

Relies on private Orbax names (``orbax-checkpoint`` 0.12.x; tests/test_checkpoint.py
fails loudly when they move): the numpy handler's serialization helpers, the default
barrier timeout, the awaitable-signal key prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import dataclasses
import hashlib
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers as ocp_type_handlers
from orbax.checkpoint._src.futures import future as ocp_future
from orbax.checkpoint._src.multihost import multihost as ocp_multihost
from orbax.checkpoint._src.path import step as ocp_step
from orbax.checkpoint._src.serialization import ocdbt_utils as ocp_ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ocp_ts_utils

from jaxft.events import EventLog

PyTree = Any

FORMAT = "jaxft-checkpoint/1"
STATE_ITEM = "state"
REJECTED_DIR = "rejected"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
DEFAULT_BARRIER_TIMEOUT_S = 60.0
DEFAULT_ASYNC_TIMEOUT_S = 600.0
DEFAULT_DEAD_AFTER_S = 5.0  # a save member whose heartbeat stalls this long is dead


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used."""


class CheckpointRejected(CheckpointError):
    """A finalized checkpoint that does not read back as complete and intact."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"checkpoint {path} rejected: {reason}")


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint of a different model (other tree structure, shapes or dtypes)."""


class SaveAbandoned(RuntimeError):
    """A save gave up waiting for a member that died."""


# -- state layout and checksum ------------------------------------------------------------

def _leaf_name(index: int, path) -> str:
    text = re.sub(r"[^A-Za-z0-9]+", "_", jax.tree_util.keystr(path)).strip("_")
    return f"{index:05d}_{text[:60]}" if text else f"{index:05d}"


def _host_copy(x) -> np.ndarray:
    """A private host copy (the device-to-host snapshot of a single-device or numpy leaf)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)  # a replicated global array: this process's replica
    return np.array(x, copy=True)


def flatten_state(tree: PyTree) -> tuple[dict[str, np.ndarray], list[list], Any]:
    """``(named host copies, [[name, keypath, dtype, shape]...], treedef)`` of a pytree."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    named: dict[str, np.ndarray] = {}
    layout = []
    for i, (path, leaf) in enumerate(leaves):
        arr = _host_copy(leaf)
        name = _leaf_name(i, path)
        named[name] = arr
        layout.append([name, jax.tree_util.keystr(path), arr.dtype.name, list(arr.shape)])
    return named, layout, treedef


def state_checksum(step: int, named: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over the step and every leaf's name, dtype, shape and bytes (in name order)."""
    h = hashlib.sha256(f"{FORMAT}\nstep={int(step)}\n".encode())
    for name in sorted(named):
        a = np.ascontiguousarray(named[name])
        h.update(f"{name}|{a.dtype.name}|{tuple(a.shape)}\n".encode())
        if a.size:
            h.update(a.reshape(-1).view(np.uint8))
    return "sha256:" + h.hexdigest()


# -- Orbax plumbing -----------------------------------------------------------------------

class _PrimaryNumpyHandler(ocp_type_handlers.NumpyHandler):
    """Orbax's ``NumpyHandler`` (same format), writing from ``primary_host``.

    Orbax's own handler writes replicated numpy arrays only on ``process_index() == 0``;
    with process 0 dead that would publish a checkpoint without data. ``before_commit``
    runs after the writes and before the handler's commit future resolves, i.e. before
    Orbax writes the step metadata and publishes.
    """

    def __init__(self, primary_host: int, before_commit: Callable[[], None] | None = None):
        super().__init__(deepcopy_host_arrays=False)  # our snapshot is already private
        self._primary = primary_host
        self._before_commit = before_commit

    async def _background_serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        writes = []
        is_primary = ocp_multihost.process_index() == self._primary
        for value, info, arg in zip(values, infos, args):
            await info.await_path_creation()
            spec = ocp_ts_utils.build_array_write_spec(
                info=info, arg=arg, global_shape=value.shape, local_shape=value.shape,
                dtype=value.dtype, use_ocdbt=info.is_ocdbt_checkpoint,
                process_index=ocp_ocdbt_utils.get_process_index_for_subdir(
                    use_ocdbt=info.is_ocdbt_checkpoint,
                    override_ocdbt_process_id=self._override_ocdbt_process_id),
                metadata_key=self._metadata_key)
            if is_primary:
                writes.append(self._open_and_write(value, spec.json, info.ts_context))
        await asyncio.gather(*writes)
        if is_primary and self._before_commit is not None:
            await asyncio.to_thread(self._before_commit)


class _Heartbeat:
    """This process's liveness signal for :class:`_KVBarrier`: a counter in the key-value
    store under a per-process nonce, bumped every ``period_s`` by a daemon thread."""

    _instance: "_Heartbeat | None" = None
    _lock = threading.Lock()

    def __init__(self, period_s: float = 0.5):
        self.nonce = f"{jax.process_index()}-{os.getpid()}-{os.urandom(4).hex()}"
        self.period_s = period_s
        self._thread: threading.Thread | None = None

    @classmethod
    def get(cls) -> "_Heartbeat":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            cls._instance._start()
            return cls._instance

    @staticmethod
    def key(nonce: str) -> str:
        return f"jaxft/ckpt_alive/{nonce}"

    def _start(self) -> None:
        if self._thread is not None:
            return
        from jaxft.runtime import distributed_client

        client = distributed_client()
        client.key_value_set(self.key(self.nonce), "0", allow_overwrite=True)
        self._stop = threading.Event()

        def beat() -> None:
            n = 0
            while not self._stop.wait(self.period_s):
                n += 1
                try:
                    client.key_value_set(self.key(self.nonce), str(n), allow_overwrite=True)
                except Exception:  # noqa: BLE001 - the service is gone: the job is ending
                    return

        self._thread = threading.Thread(target=beat, name="jaxft-ckpt-heartbeat", daemon=True)
        self._thread.start()
        # Stop before interpreter teardown (and before jax's own atexit shutdown of the
        # client): a daemon thread caught inside a gRPC call at teardown aborts the process.
        atexit.register(self.stop)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)


# Orbax barrier names (orbax-checkpoint 0.12.x) the barrier below knows about.
_COMMIT_KEY = "async_commit_complete"  # after the primary published (background thread)
_FINALIZE_KEY = "ThreadSaveMultiHostValueHolder:set_value_start"  # save-in-progress flag (2nd: finalize)


class _KVBarrier:
    """An Orbax ``BarrierSyncFn`` on the coordination service's key-value store.

    Each process writes ``<namespace>/<key>/<n>/<process>`` = its heartbeat nonce and
    polls the directory until every expected process has written. Unlike
    ``wait_at_barrier`` (which waits its full timeout for a dead process) it gives up,
    raising :class:`SaveAbandoned`, as soon as

    * ``cancel`` is set (a member of the save is known to have died: the trainer committed
      a step without it), or
    * a missing member's heartbeat stopped for ``dead_after_s`` (its nonce is learnt from
      an earlier barrier of the same save), or
    * a missing member never reached any barrier of the save within ``unknown_after_s``.

    Arrival keys outlive their writer, so a member that arrived and then died does not
    block the others: a save whose members all finished their part completes.
    """

    def __init__(self, namespace: str, processes: Sequence[int], me: int, cancel: threading.Event, *,
                 dead_after_s: float = DEFAULT_DEAD_AFTER_S, unknown_after_s: float = DEFAULT_BARRIER_TIMEOUT_S,
                 poll_s: float = 0.005, max_poll_s: float = 0.05):
        self.namespace = namespace
        self.processes = frozenset(processes)
        self.me = me
        self.cancel = cancel
        self.dead_after_s = dead_after_s
        self.unknown_after_s = unknown_after_s
        self.poll_s, self.max_poll_s = poll_s, max_poll_s
        self.nonces: dict[int, str] = {}
        self._beats: dict[str, tuple[str | None, float]] = {}  # nonce -> (value, when it last changed)
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._created = time.monotonic()
        self._committed = False  # passed Orbax's "async_commit_complete" barrier

    def _dead(self, client, process: int, now: float) -> str | None:
        nonce = self.nonces.get(process)
        if nonce is None:
            if now - self._created > self.unknown_after_s:
                return f"process {process} reached no barrier of this save in {self.unknown_after_s:.0f} s"
            return None
        try:
            value = client.key_value_try_get(_Heartbeat.key(nonce))
        except Exception:  # noqa: BLE001 - NOT_FOUND is raised
            value = None
        with self._lock:
            last, since = self._beats.get(nonce, (None, now))
            if value != last or nonce not in self._beats:
                self._beats[nonce] = (value, now)
                return None
        if now - since > self.dead_after_s:
            return f"process {process} stopped heartbeating {now - since:.1f} s ago"
        return None

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        if self.processes <= {self.me}:
            return
        if self.cancel.is_set():
            raise SaveAbandoned(f"barrier {key}: save abandoned")
        from jaxft.runtime import distributed_client

        client = distributed_client()
        nonce = _Heartbeat.get().nonce
        with self._lock:
            n = self._counts.get(key, 0)
            self._counts[key] = n + 1
            self.nonces[self.me] = nonce
        if _FINALIZE_KEY in key and n >= 1 and not self._committed:
            # Orbax's finalize thread always resets its "save in progress" value (this
            # barrier) in a `finally`; reaching it without having passed the commit barrier
            # means this process's background phase failed (a write error, an abandoned
            # barrier). Say so at once: peers must not wait for us until their timeout.
            why = f"process {self.me}: background phase failed before the commit barrier"
            self.abandon(why)
            raise SaveAbandoned(f"barrier {key}: {why}")
        base = f"{self.namespace}/{key}/{n}/"
        client.key_value_set(base + str(self.me), nonce, allow_overwrite=True)
        deadline = time.monotonic() + max(timeout_ms, 1) / 1000
        delay = self.poll_s
        try:
            while True:
                arrived = set()
                for k, v in client.key_value_dir_get(base):
                    p = int(k.rstrip("/").rsplit("/", 1)[-1])
                    arrived.add(p)
                    with self._lock:
                        self.nonces.setdefault(p, v)
                missing = self.processes - arrived
                if not missing:
                    if _COMMIT_KEY in key:
                        self._committed = True
                    return
                if self.cancel.is_set():
                    raise SaveAbandoned(f"barrier {key}: processes {sorted(missing)} died before arriving")
                given_up = client.key_value_dir_get(f"{self.namespace}/abandoned/")
                if given_up:
                    k, why = given_up[0]
                    raise SaveAbandoned(f"barrier {key}: process {k.rstrip('/').rsplit('/', 1)[-1]} "
                                        f"abandoned the save ({why})")
                now = time.monotonic()
                for p in sorted(missing):
                    why = self._dead(client, p, now)
                    if why is not None:
                        raise SaveAbandoned(f"barrier {key}: {why}")
                if now > deadline:
                    raise TimeoutError(f"barrier {key}: processes {sorted(missing)} did not arrive "
                                       f"within {timeout_ms / 1000:.0f} s")
                time.sleep(delay)
                delay = min(delay * 1.5, self.max_poll_s)
        except (SaveAbandoned, TimeoutError) as e:
            self.abandon(str(e))
            raise

    def abandon(self, reason: str) -> None:
        """Tell the other members this process gave up the save (they stop waiting for it)."""
        if self.processes <= {self.me}:
            return
        try:
            from jaxft.runtime import distributed_client

            distributed_client().key_value_set(f"{self.namespace}/abandoned/{self.me}", reason[:300],
                                               allow_overwrite=True)
        except Exception:  # noqa: BLE001 - best effort; the others still have heartbeats and timeouts
            pass


def _set_orbax_barrier_timeout(seconds: float) -> None:
    """Bound Orbax's blocking barriers (``sync_global_processes``; default 300 s)."""
    ocp_multihost._DEFAULT_BARRIER_TIMEOUT = max(1, int(seconds))


_SIGNAL_PREFIX_SET = False


def _private_signal_keys() -> None:
    """Give this process life its own Orbax "awaitable signal" keys.

    Orbax keys those signals in the coordination service by a per-process operation
    counter. The service outlives the workers here, so a restarted process would count
    from 1 again and meet the keys an abandoned save of a dead process left behind (a
    stale "directory created" signal, or a contract naming a signal never sent). jaxft
    creates step directories synchronously (``create_directories_asynchronously=False``),
    so no signal needs to cross processes; a unique prefix keeps each life's keys apart.
    """
    global _SIGNAL_PREFIX_SET
    if not _SIGNAL_PREFIX_SET:
        ocp_future.AwaitableSignalsContract.awaitable_signals_contract_prefix = (
            f"awaitable_signals_contract_jaxft_{os.getpid()}_{os.urandom(4).hex()}")
        _SIGNAL_PREFIX_SET = True


class _LiveSetCheckpointManager(ocp.CheckpointManager):
    """A ``CheckpointManager`` without JAX's preemption sync point.

    Orbax asks ``multihost_utils.reached_preemption_sync_point`` at every save; after a
    SIGTERM notice that agreement involves every process of the job, dead ones included.
    jaxft saves on its own schedule, over the live set only.
    """

    def reached_preemption(self, step: int) -> bool:
        return False


def _registry(mp: ocp.options.MultiprocessingOptions, numpy_handler: _PrimaryNumpyHandler):
    handler = ocp.PyTreeCheckpointHandler(
        multiprocessing_options=mp,
        type_handler_registry=ocp_type_handlers.create_type_handler_registry((np.ndarray, numpy_handler)))
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(STATE_ITEM, ocp.args.PyTreeSave, handler)
    registry.add(STATE_ITEM, ocp.args.PyTreeRestore, handler)
    return registry


def _digest(members: Sequence[int], incarnations: Mapping[int, int] | None) -> str:
    incarnations = incarnations or {}
    text = ",".join(f"{p}:{incarnations.get(p, '?')}" for p in sorted(members))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _root_cause(e: BaseException) -> str:
    """The first line of the exception that started it all (Orbax re-raises in `finally`)."""
    seen = []
    while e is not None and e not in seen and len(seen) < 20:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return _first_line(seen[-1])


# -- saves in flight ----------------------------------------------------------------------

class _Save:
    """One async save: its manager, its cancel flag, and a watcher that logs the outcome."""

    def __init__(self, store: "CheckpointStore", step: int, members: tuple[int, ...],
                 incarnations: Mapping[int, int] | None, digest: str, mgr, cancel: threading.Event,
                 t0: float, blocking_ms: float, prefix: str = "", barrier: "_KVBarrier | None" = None):
        self.store = store
        self.prefix = prefix
        self.barrier = barrier
        self.step = step
        self.members = members
        self.incarnations = dict(incarnations or {})
        self.digest = digest
        self.mgr = mgr
        self.cancel = cancel
        self.t0 = t0
        self.blocking_ms = blocking_ms
        self.path = store.step_path(step)
        self.done = threading.Event()
        self.ok: bool | None = None
        self.reason: str | None = None
        self._error: BaseException | None = None
        # Not daemon threads: they may call into the distributed client (gRPC), and a daemon
        # thread caught in such a call at interpreter teardown aborts the process. They end
        # when Orbax's own (non-daemon) save threads end, which are bounded.
        self._thread = threading.Thread(target=self._watch, name=f"jaxft-ckpt-{step}")

    def start(self) -> None:
        self._thread.start()

    def _wait_manager(self) -> None:
        try:
            self.mgr.wait_until_finished()
        except BaseException as e:  # noqa: BLE001 - reported, never fatal to training
            self._error = e

    def _watch(self) -> None:
        """Log ``checkpoint_saved`` as soon as the step directory is published (the primary's
        rename), or ``checkpoint_abandoned`` when the save ended without publishing."""
        waiter = threading.Thread(target=self._wait_manager, name=f"jaxft-ckpt-wait-{self.step}")
        waiter.start()
        primary = self.members[0] == self.store.process_id
        delay = 0.005
        while True:
            ended = not waiter.is_alive()
            if self.ok is None and _is_finalized(self.path):
                self.ok = True
                self.store.events.log("checkpoint_saved", step=self.step, path=self.path,
                                      blocking_ms=self.blocking_ms,
                                      write_ms=round((time.perf_counter() - self.t0) * 1000, 2),
                                      processes=list(self.members), primary=primary)
                if primary:
                    self.store._remove_stale_tmp(self.step)
            if ended:
                break
            waiter.join(delay)
            delay = min(delay * 1.5, 0.1)
        if self.ok is None:
            self.ok = False
            self.reason = _root_cause(self._error) if self._error is not None else "not published"
            if self.barrier is not None:  # e.g. a write error here: peers must not wait for us
                self.barrier.abandon(self.reason)
            self.store.events.log("checkpoint_abandoned", step=self.step, path=self.path, reason=self.reason,
                                  blocking_ms=self.blocking_ms, processes=list(self.members))
        _close_quietly(self.mgr)
        self.done.set()

    def lost_member(self, members: Sequence[int], incarnations: Mapping[int, int] | None) -> bool:
        """Whether a member of this save is dead (absent, or restarted) in the new member map."""
        current = set(members)
        for p in self.members:
            if p not in current:
                return True
            if incarnations and p in self.incarnations and incarnations.get(p) != self.incarnations[p]:
                return True
        return False

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


def _close_quietly(mgr) -> None:
    try:
        mgr.close()
    except BaseException:  # noqa: BLE001 - the failed save is already reported
        try:
            mgr._checkpointer.close()
        except BaseException:  # noqa: BLE001
            pass


def _is_finalized(path: str) -> bool:
    try:
        return os.path.isdir(path) and bool(ocp_step.is_path_finalized(path))
    except Exception:  # noqa: BLE001
        return False


@dataclasses.dataclass
class Restored:
    """A checkpoint read back completely and verified."""

    step: int
    path: str
    tree: PyTree  # the template's structure (or ``{name: array}`` without a template)
    metadata: dict


# -- the store ----------------------------------------------------------------------------

class CheckpointStore:
    """Async, live-set-aware saves into one directory, and validated restores from it.

    Every member of a save must call :meth:`save` for the same step with the same
    ``members`` (the processes of the commit being saved), as for any collective.

    Args:
      directory: checkpoint root (created if missing; Orbax gets ``create=False``).
      keep: ``max_to_keep``: complete checkpoints kept (older ones deleted by Orbax).
      events: where ``checkpoint_*`` / ``restored`` events go.
      barrier_timeout_s: bound of every blocking Orbax barrier (all are scoped to the
        save's live processes).
      async_timeout_s: bound of the background phase (writes and its barriers) of a save
        whose members all stay alive.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3, events: EventLog | None = None,
                 process_id: int | None = None, barrier_timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S,
                 async_timeout_s: float = DEFAULT_ASYNC_TIMEOUT_S, dead_after_s: float = DEFAULT_DEAD_AFTER_S):
        self.directory = os.path.abspath(os.fspath(directory))
        self.dead_after_s = dead_after_s
        self.keep = keep
        self.process_id = jax.process_index() if process_id is None else process_id
        self.events = events or EventLog(None, self.process_id)
        self.barrier_timeout_s = barrier_timeout_s
        self.async_timeout_s = async_timeout_s
        os.makedirs(self.directory, exist_ok=True)
        _set_orbax_barrier_timeout(barrier_timeout_s)
        _private_signal_keys()
        self._current: _Save | None = None
        self._detached: list[_Save] = []

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(int(step)))

    # -- saving -------------------------------------------------------------------------
    def _manager(self, members: tuple[int, ...], prefix: str, cancel: threading.Event,
                 before_commit: Callable[[], None] | None):
        mp = ocp.options.MultiprocessingOptions(primary_host=members[0], active_processes=set(members),
                                                barrier_sync_key_prefix=prefix)
        barrier = _KVBarrier(f"jaxft/ckpt/{prefix}", members, self.process_id, cancel,
                             dead_after_s=self.dead_after_s, unknown_after_s=self.barrier_timeout_s)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep, create=False, enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(timeout_secs=max(1, int(self.async_timeout_s)), barrier_sync_fn=barrier,
                                           create_directories_asynchronously=False),
            multiprocessing_options=mp, save_root_metadata=False, cleanup_tmp_directories=False,
            lightweight_initialize=True)
        handler = _PrimaryNumpyHandler(members[0], before_commit)
        mgr = _LiveSetCheckpointManager(self.directory, options=options, handler_registry=_registry(mp, handler))
        return mgr, barrier

    def save(self, step: int, tree: PyTree, *, members: Sequence[int] | None = None,
             incarnations: Mapping[int, int] | None = None, metadata: Mapping[str, Any] | None = None,
             ) -> _Save | None:
        """Start an async save of ``tree`` as ``step``; returns once the host snapshot is taken.

        Returns the in-flight save, or None if the blocking phase failed (reported as
        ``checkpoint_abandoned``; training goes on).
        """
        t0 = time.perf_counter()
        step = int(step)
        me = self.process_id
        members = tuple(sorted(set(members) if members else {me}))
        if me not in members:
            raise ValueError(f"process {me} saves but is not among members {list(members)}")
        digest = _digest(members, incarnations)
        self.notice_members(members, incarnations)
        prev = self._current
        self._current = None
        if prev is not None:
            if prev.digest == digest:
                prev.wait()  # Orbax semantics: one save at a time per manager lineage
            else:
                self._detached.append(prev)  # other members: finishes or is cancelled on its own
        self.poll()

        named, layout, treedef = flatten_state(tree)  # the device-to-host snapshot
        named_step = np.asarray(step, np.int64)
        meta: dict[str, Any] = {"format": FORMAT, "step": step, "processes": list(members),
                                "primary": members[0], "treedef": str(treedef), "leaves": layout}
        if metadata:
            meta["user"] = dict(metadata)
        meta["checksum"] = None  # filled in by the primary's background thread (same dict size)
        checksum_done = threading.Event()

        def before_commit() -> None:  # on the primary, before Orbax writes the step metadata
            checksum_done.wait()

        if me == members[0]:
            def compute() -> None:
                try:
                    meta["checksum"] = state_checksum(step, named)
                finally:
                    checksum_done.set()

            threading.Thread(target=compute, name=f"jaxft-ckpt-sum-{step}", daemon=True).start()
        else:
            checksum_done.set()

        cancel = threading.Event()
        prefix = f"jaxft_ckpt_{digest}_{step}"
        mgr = barrier = None
        try:
            mgr, barrier = self._manager(members, prefix, cancel, before_commit)
            # Orbax refuses zero-size arrays: they live in the layout (dtype, shape) only.
            item = {"step": named_step, "leaves": {n: a for n, a in named.items() if a.size}}
            mgr.save(step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeSave(item)}),
                     custom_metadata=meta, force=True)
        except Exception as e:  # noqa: BLE001 - a failed save must not stop training
            cancel.set()
            checksum_done.set()
            if barrier is not None:
                barrier.abandon(_first_line(e))
            if mgr is not None:
                _close_quietly(mgr)
            self.events.log("checkpoint_abandoned", step=step, path=self.step_path(step), reason=_first_line(e),
                            phase="blocking", processes=list(members))
            return None
        blocking_ms = round((time.perf_counter() - t0) * 1000, 2)
        self.events.log("checkpoint_started", step=step, blocking_ms=blocking_ms, processes=list(members))
        if prev is not None and prev.digest == digest and me == members[0] and len(members) > 1:
            # Every member finished the previous save before this one's barriers passed.
            self._delete_barrier_keys(prev.prefix)
        save = _Save(self, step, members, incarnations, digest, mgr, cancel, t0, blocking_ms, prefix, barrier)
        save.start()
        self._current = save
        return save

    @staticmethod
    def _delete_barrier_keys(prefix: str) -> None:
        try:
            from jaxft.runtime import distributed_client

            distributed_client().key_value_delete(f"jaxft/ckpt/{prefix}/")
        except Exception:  # noqa: BLE001 - housekeeping only
            pass

    def notice_members(self, members: Sequence[int], incarnations: Mapping[int, int] | None = None) -> None:
        """Abandon in-flight saves that wait for a process no longer alive (call at each commit)."""
        for s in [self._current, *self._detached]:
            if s is not None and not s.done.is_set() and not s.cancel.is_set() and s.lost_member(members, incarnations):
                s.cancel.set()

    def poll(self) -> None:
        """Forget finished saves (their outcome is already logged)."""
        self._detached = [s for s in self._detached if not s.done.is_set()]

    def in_flight(self) -> list[_Save]:
        return [s for s in [self._current, *self._detached] if s is not None and not s.done.is_set()]

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every save in flight; True if all finished (published or abandoned)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for s in self.in_flight():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not s.wait(left):
                return False
        self.poll()
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Wait (bounded) for saves in flight; abandon those that outlast ``timeout``."""
        timeout = self.async_timeout_s if timeout is None else timeout
        finished = self.wait(timeout)
        if not finished:
            for s in self.in_flight():
                s.cancel.set()
            self.wait(10.0)
        return finished

    def _remove_stale_tmp(self, published_step: int) -> None:
        """Delete abandoned ``<n>.orbax-checkpoint-tmp`` dirs older than a published step.

        (A save of an older step still running elsewhere could only publish a checkpoint
        that is already superseded; losing it costs nothing.)
        """
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            m = re.fullmatch(r"(\d+)" + re.escape(TMP_SUFFIX) + r".*", name)
            if m and int(m.group(1)) < published_step:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    # -- restoring ----------------------------------------------------------------------
    def _reader(self):
        me = self.process_id
        mp = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                                barrier_sync_key_prefix=f"jaxft_ckpt_read_{me}")
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, enable_async_checkpointing=False,
                                               save_interval_steps=0,
                                               multiprocessing_options=mp, save_root_metadata=False,
                                               lightweight_initialize=True)
        return _LiveSetCheckpointManager(self.directory, options=options,
                                         handler_registry=_registry(mp, _PrimaryNumpyHandler(me)))

    def steps(self) -> list[int]:
        """Finalized (published) steps, oldest first. Each process reads on its own."""
        if not os.path.isdir(self.directory):
            return []
        mgr = self._reader()
        try:
            return sorted(int(s) for s in mgr.all_steps())
        finally:
            _close_quietly(mgr)

    def restore(self, step: int, template: PyTree | None = None) -> Restored:
        """Read ``step`` back completely and verify it; raises :class:`CheckpointRejected`.

        With ``template`` the result has the template's structure, and the checkpoint
        must match its leaves' shapes and dtypes (:class:`CheckpointMismatch`
        otherwise). Only this process takes part (no barrier), so every process can
        restore independently.
        """
        path = self.step_path(step)
        mgr = self._reader()
        try:
            try:
                meta = mgr.metadata(step).custom_metadata or {}
            except Exception as e:  # noqa: BLE001
                raise CheckpointRejected(path, f"unreadable metadata: {_first_line(e)}") from e
            if meta.get("format") != FORMAT or not meta.get("checksum") or "leaves" not in meta:
                raise CheckpointRejected(path, "metadata lacks the jaxft format, leaves or checksum")
            if int(meta.get("step", -1)) != int(step):
                raise CheckpointRejected(path, f"metadata says step {meta.get('step')}, directory says {step}")
            layout = meta["leaves"]
            names = [row[0] for row in layout if int(np.prod(row[3])) > 0]
            empty = {row[0]: _empty(row[2], row[3]) for row in layout if int(np.prod(row[3])) == 0}
            np_args = ocp.RestoreArgs(restore_type=np.ndarray)
            restore_args = {"step": np_args, "leaves": {n: np_args for n in names}}
            try:
                out = mgr.restore(step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeRestore(
                    restore_args=restore_args)}))
                item = out[STATE_ITEM]
            except Exception as e:  # noqa: BLE001
                raise CheckpointRejected(path, f"read failed: {_first_line(e)}") from e
        finally:
            _close_quietly(mgr)
        leaves = item.get("leaves", {}) if isinstance(item, Mapping) else {}
        named = {n: np.asarray(leaves[n]) for n in names if n in leaves}
        if len(named) != len(names) or set(leaves) != set(names):
            raise CheckpointRejected(path, f"leaves missing or unexpected: {len(leaves)} read, {len(names)} recorded")
        named.update(empty)
        for name, _, dtype, shape in layout:
            a = named[name]
            if a.dtype.name != dtype or list(a.shape) != list(shape):
                raise CheckpointRejected(path, f"leaf {name} read as {a.dtype.name}{list(a.shape)}, "
                                               f"recorded {dtype}{list(shape)}")
        if int(np.asarray(item.get("step", -1))) != int(step):
            raise CheckpointRejected(path, f"stored step {item.get('step')} != {step}")
        got = state_checksum(step, named)
        if got != meta["checksum"]:
            raise CheckpointRejected(path, f"checksum mismatch (stored {meta['checksum'][:23]}..., "
                                           f"read {got[:23]}...)")
        tree: PyTree = named
        if template is not None:
            tree = _unflatten_like(template, layout, named, path)
        return Restored(step=int(step), path=path, tree=tree, metadata=meta)

    def restore_latest(self, template: PyTree | None = None, *, quarantine: bool = True) -> Restored | None:
        """Restore the newest checkpoint that verifies; reject (and move aside) broken ones.

        A checkpoint that vanishes while being read (deleted by ``max_to_keep`` on a live
        primary, or moved aside by a peer that rejected it first) is not reported as
        rejected: the directory is listed again instead, since a newer one may exist.
        """
        for _ in range(5):
            relist = False
            for step in reversed(self.steps()):
                path = self.step_path(step)
                t0 = time.perf_counter()
                try:
                    restored = self.restore(step, template)
                except CheckpointRejected as e:
                    if not os.path.isdir(path):
                        relist = True
                        break
                    moved = self._quarantine(path) if quarantine else None
                    self.events.log("checkpoint_rejected", path=path, step=step, reason=e.reason, moved_to=moved)
                    continue
                self.events.log("restored", step=restored.step, path=path,
                                seconds=round(time.perf_counter() - t0, 4))
                return restored
            if not relist:
                return None
        return None

    def _quarantine(self, path: str) -> str | None:
        """Move a rejected checkpoint to ``<dir>/rejected/`` so its step can be saved again."""
        dest_dir = os.path.join(self.directory, REJECTED_DIR)
        dest = os.path.join(dest_dir, f"{os.path.basename(path)}.{time.time_ns()}.p{self.process_id}")
        try:
            os.makedirs(dest_dir, exist_ok=True)
            os.rename(path, dest)
            return dest
        except OSError:  # another process moved it first, or it vanished
            return None


def _empty(dtype: str, shape) -> np.ndarray:
    try:
        return np.empty(tuple(shape), np.dtype(dtype))
    except TypeError:  # ml_dtypes names (bfloat16, float8_*) are not numpy built-ins
        import ml_dtypes

        return np.empty(tuple(shape), getattr(ml_dtypes, dtype))


def _unflatten_like(template: PyTree, layout: list, named: Mapping[str, np.ndarray], path: str) -> PyTree:
    t_leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    if len(t_leaves) != len(layout):
        raise CheckpointMismatch(f"checkpoint {path} has {len(layout)} leaves, the model has {len(t_leaves)}; "
                                 "use another checkpoint directory for a different model")
    out = []
    for (kp, leaf), (name, keystr, dtype, shape) in zip(t_leaves, layout):
        want_dtype = np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))
        want_shape = list(np.shape(leaf))
        if jax.tree_util.keystr(kp) != keystr or want_dtype.name != dtype or want_shape != list(shape):
            raise CheckpointMismatch(
                f"checkpoint {path}: leaf {keystr} {dtype}{list(shape)} does not match the model's "
                f"{jax.tree_util.keystr(kp)} {want_dtype.name}{want_shape}; use another checkpoint "
                "directory for a different model")
        out.append(named[name])
    return jax.tree_util.tree_unflatten(treedef, out)


# -- trainer integration ------------------------------------------------------------------

def _incarnations(record, trainer=None) -> dict[int, int] | None:
    """The agreed coordination-service incarnations of a commit's members (None if the
    record does not carry them; then save namespaces are keyed by members and step)."""
    given = record.incarnations
    if given and all(p in given for p in record.members):
        return {p: int(given[p]) for p in record.members}
    return None


def resolve_directory(directory: str | os.PathLike | None, environ=os.environ) -> str:
    """``directory``, or ``$JAXFT_RUN_DIR/checkpoints`` (set by ``jaxft launch --run-dir``)."""
    if directory is not None:
        return os.fspath(directory)
    from jaxft import envvars

    run_dir = environ.get(envvars.RUN_DIR)
    if not run_dir:
        raise ValueError("checkpointing needs a directory: pass one, or run under "
                         "jaxft launch --run-dir (which sets $JAXFT_RUN_DIR)")
    return os.path.join(run_dir, "checkpoints")


class ElasticCheckpointer:
    """Checkpoints an :class:`~jaxft.ElasticTrainer` every ``every`` committed steps.

    Usage::

        ckpt = ElasticCheckpointer(directory, every=5, keep=3, runtime=rt, data=data)
        trainer = ElasticTrainer(..., on_commit=ckpt.on_commit)   # or call it from yours
        ckpt.restore(trainer)           # before training: cold restore if a checkpoint exists
        trainer.run(num_steps)
        ckpt.close()                    # wait for the last save

    Checkpoint ``N`` holds the state after ``N`` committed steps (``trainer.state.step``),
    so it is saved at the commit of step index ``N - 1``. The fault point
    ``during-save`` fires with ``N`` right after the save started and before it completes.
    """

    def __init__(self, directory: str | os.PathLike, *, every: int = 0, keep: int | None = 3, runtime=None,
                 events: EventLog | None = None, faults=None, data=None, metadata: Mapping[str, Any] | None = None,
                 barrier_timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S,
                 async_timeout_s: float = DEFAULT_ASYNC_TIMEOUT_S, dead_after_s: float = DEFAULT_DEAD_AFTER_S):
        if every < 0:
            raise ValueError(f"every must be >= 0, got {every}")
        self.every = every
        self.events = events or (runtime.events if runtime is not None else None)
        self.faults = faults or (runtime.faults if runtime is not None else None)
        self.store = CheckpointStore(directory, keep=keep, events=self.events,
                                     barrier_timeout_s=barrier_timeout_s, async_timeout_s=async_timeout_s,
                                     dead_after_s=dead_after_s)
        self.events = self.store.events
        self.metadata = dict(metadata or {})
        if data is not None:  # data order and position are functions of (seed, step) here
            self.metadata.setdefault("data", {"seed": int(data.seed), "global_batch": int(data.global_batch),
                                              "num_examples": int(data.num_examples),
                                              "shuffle": bool(getattr(data, "shuffle", True))})
        self.restored: Restored | None = None
        self._last_record = None

    @property
    def directory(self) -> str:
        return self.store.directory

    def restore(self, trainer) -> Restored | None:
        """Cold restore into ``trainer`` (before training); None if there is no usable checkpoint."""
        from jaxft.trainer import TrainState

        s = trainer.state
        restored = self.store.restore_latest({"params": s.params, "opt_state": s.opt_state})
        if restored is not None:
            trainer.restore(TrainState(restored.step, restored.tree["params"], restored.tree["opt_state"]))
            saved_data = dict((restored.metadata.get("user") or {}).get("data") or {})
            saved_data.pop("position", None)
            if saved_data and "data" in self.metadata and saved_data != self.metadata["data"]:
                self.events.log("checkpoint_data_mismatch", step=restored.step, saved=saved_data,
                                current=self.metadata["data"])
        self.restored = restored
        return restored

    def on_commit(self, trainer, record) -> None:
        """The trainer hook: abandon saves waiting on dead members; save every ``every`` steps."""
        self._last_record = record
        incs = _incarnations(record, trainer)
        self.store.notice_members(record.members, incs)
        self.store.poll()
        step = trainer.state.step
        if self.every and step % self.every == 0:
            self.save(trainer, record, incarnations=incs)

    def save(self, trainer, record=None, *, incarnations: Mapping[int, int] | None = None) -> _Save | None:
        """Save the committed state now (on demand), as checkpoint ``trainer.state.step``.

        Like any collective, every member of the commit (``record``, by default the last
        one :meth:`on_commit` saw) must call it at the same commit: from ``on_commit``
        with a condition that depends on the step only, or after ``trainer.run`` returns.
        Returns once the host snapshot is taken; the write goes on in the background.
        """
        record = record if record is not None else self._last_record
        if record is None:
            raise ValueError("save() needs the StepRecord of the commit to save (no commit seen yet)")
        s = trainer.state
        step = int(s.step)
        incs = incarnations if incarnations is not None else _incarnations(record, trainer)
        meta = dict(self.metadata)
        if "data" in meta:
            meta["data"] = dict(meta["data"], position=step * meta["data"]["global_batch"])
        meta["rng"] = "parameters and data order derive from the seeds above and the step"
        meta["members"] = list(record.members)
        save = self.store.save(step, {"params": s.params, "opt_state": s.opt_state}, members=record.members,
                               incarnations=incs, metadata=meta)
        if self.faults is not None:
            self.faults.point("during-save", step)
        return save

    def close(self, timeout: float | None = None) -> bool:
        """Wait for the saves in flight (bounded); call once training is over."""
        return self.store.close(timeout)


# -- benchmark ----------------------------------------------------------------------------

def _bench_state(nbytes: float, seed: int = 0):
    import jax.numpy as jnp

    n_leaves = 8
    per = int(nbytes) // (4 * n_leaves)
    side = int(np.sqrt(per))
    rng = np.random.default_rng(seed)
    params = {f"w{i}": jnp.asarray(rng.standard_normal((side, per // side), dtype=np.float32))
              for i in range(n_leaves)}
    jax.block_until_ready(params)
    return params


def bench_async_vs_sync(nbytes: float = 100e6, repeats: int = 3, directory: str | None = None) -> dict:
    """Step-loop blocking time of an async save vs the time of a synchronous save.

    Single process, a ~``nbytes`` state of float32 jax arrays. Async: the time
    :meth:`CheckpointStore.save` keeps the caller (host snapshot + Orbax's blocking
    phase), and the time until the save is published. Sync: the same state saved by an
    Orbax ``CheckpointManager`` with async checkpointing off (same handler and format).
    """
    params = _bench_state(nbytes)
    size = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    root = directory or tempfile.mkdtemp(prefix="jaxft-ckpt-bench-")
    events = EventLog(None, jax.process_index())
    try:
        store = CheckpointStore(os.path.join(root, "async"), keep=2, events=events)
        blocking, total = [], []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            save = store.save(i + 1, params)
            t1 = time.perf_counter()
            save.wait()
            t2 = time.perf_counter()
            if not save.ok:
                raise RuntimeError(f"async save failed: {save.reason}")
            if i:  # the first save pays one-time costs (imports, tensorstore contexts)
                blocking.append(t1 - t0)
                total.append(t2 - t0)
        store.close()

        sync_dir = os.path.join(root, "sync")
        os.makedirs(sync_dir, exist_ok=True)
        me = jax.process_index()
        mp = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
        sync_times = []
        for i in range(repeats + 1):
            mgr = _LiveSetCheckpointManager(
                sync_dir, options=ocp.CheckpointManagerOptions(
                    max_to_keep=2, create=False, enable_async_checkpointing=False, multiprocessing_options=mp,
                    save_root_metadata=False),
                handler_registry=_registry(mp, _PrimaryNumpyHandler(me)))
            t0 = time.perf_counter()
            named, layout, _ = flatten_state(params)
            meta = {"format": FORMAT, "step": i + 1, "leaves": layout,
                    "checksum": state_checksum(i + 1, named)}
            mgr.save(i + 1, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeSave(
                {"step": np.asarray(i + 1, np.int64), "leaves": named})}), custom_metadata=meta, force=True)
            mgr.wait_until_finished()
            t1 = time.perf_counter()
            mgr.close()
            if i:
                sync_times.append(t1 - t0)
    finally:
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "bytes": size,
        "async_blocking_s": float(np.median(blocking)),
        "async_total_s": float(np.median(total)),
        "sync_s": float(np.median(sync_times)),
    }
    result["ratio_blocking_over_sync"] = result["async_blocking_s"] / result["sync_s"]
    return result


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxft.checkpoint")
    parser.add_argument("--bench", action="store_true", help="async vs sync save benchmark")
    parser.add_argument("--bytes", type=float, default=100e6, help="state size for --bench")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    if not args.bench:
        parser.print_help()
        return 2
    r = bench_async_vs_sync(args.bytes, args.repeats, args.dir)
    print(f"state: {r['bytes'] / 1e6:.1f} MB")
    print(f"async save, step-loop blocking time: {r['async_blocking_s'] * 1000:8.1f} ms "
          f"(published after {r['async_total_s'] * 1000:.1f} ms)")
    print(f"synchronous save:                    {r['sync_s'] * 1000:8.1f} ms")
    print(f"ratio blocking / sync:               {r['ratio_blocking_over_sync']:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())

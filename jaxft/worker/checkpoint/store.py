"""Async saves by the live set into one directory, and validated restores from it.

* **Saves do not stall the step**: the caller pays the host copy and a few millisecond
  barriers; Orbax writes, checksums and publishes in the background.
* **Any live subset saves** (each process holds a full replica): each save has a manager
  for the members of its commit (primary ``min(members)``, every barrier scoped to them)
  and a barrier namespace unique to (members, incarnations, step).
* **Every barrier is bounded, or abandoned when a member dies**: Orbax's blocking ones by
  ``Timeouts.save_barrier``; the background ones (:class:`~jaxft.worker.checkpoint.orbax.SaveBarrier`)
  give up once a missing member is known dead (:meth:`CheckpointStore.notice_members`, or
  its heartbeat stalled for ``Timeouts.save_dead_after``).
* **No partial checkpoint**: the primary renames ``<step>.orbax-checkpoint-tmp`` to
  ``<step>`` (Orbax's publication) only once every member wrote its part; a member dying
  before that abandons the save, one dying after cannot stop the primary.
* **Validated restores**: the newest checkpoint that reads back completely with a matching
  SHA-256; a broken one is reported, moved to ``<dir>/rejected/`` and the previous one tried.

Events: ``checkpoint_started``, ``checkpoint_saved``, ``checkpoint_abandoned``,
``checkpoint_rejected``, ``restored``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxft import timeouts as timeouts_lib
from jaxft.errors import CheckpointDirectoryError, CheckpointError, CheckpointRejected
from jaxft.events import EventLog
from jaxft.protocol import Event
from jaxft.timeouts import Timeouts
from jaxft.types import PyTree
from jaxft.worker import deaths, kv
from jaxft.worker.checkpoint import orbax
from jaxft.worker.checkpoint.layout import (
    FORMAT,
    _unflatten_like,
    check_metadata,
    flatten_state,
    state_checksum,
    verified_leaves,
)

logger = logging.getLogger(__name__)

REJECTED_DIR = "rejected"
BARRIER_NAMESPACE = "jaxft/ckpt"  # key-value prefix of the background-phase barriers


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

    def __init__(self, store: CheckpointStore, step: int, members: tuple[int, ...],
                 incarnations: Mapping[int, int] | None, digest: str, mgr, cancel: threading.Event,
                 t0: float, blocking_ms: float, prefix: str = "", barrier: orbax.SaveBarrier | None = None):
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
            if self.ok is None and orbax.is_finalized(self.path):
                self.ok = True
                self.store.events.log(Event.CHECKPOINT_SAVED, step=self.step, path=self.path,
                                      blocking_ms=self.blocking_ms,
                                      write_ms=round((time.perf_counter() - self.t0) * 1000, 2),
                                      processes=list(self.members), primary=primary)
                if primary:
                    orbax.remove_stale_tmp(self.store.directory, self.step)
            if ended:
                break
            waiter.join(delay)
            delay = min(delay * 1.5, 0.1)
        if self.ok is None:
            self.ok = False
            self.reason = _root_cause(self._error) if self._error is not None else "not published"
            if self.barrier is not None:  # e.g. a write error here: peers must not wait for us
                self.barrier.abandon(self.reason)
            logger.info("checkpoint %s abandoned: %s", self.path, self.reason)
            self.store.events.log(Event.CHECKPOINT_ABANDONED, step=self.step, path=self.path, reason=self.reason,
                                  blocking_ms=self.blocking_ms, processes=list(self.members))
        orbax.close_quietly(self.mgr)
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
        save's live processes), and how long a save waits for a member that never reached
        any of its barriers. None: ``timeouts.save_barrier``.
      async_timeout_s: bound of the background phase (writes and its barriers) of a save
        whose members all stay alive. None: ``timeouts.save``.
      dead_after_s: a save member whose heartbeat stalls this long is dead. None:
        ``timeouts.save_dead_after``.
      timeouts: the settings the three above default to (None: :func:`jaxft.timeouts.current`).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3, events: EventLog | None = None,
                 process_id: int | None = None, barrier_timeout_s: float | None = None,
                 async_timeout_s: float | None = None, dead_after_s: float | None = None,
                 timeouts: Timeouts | None = None):
        self.timeouts = (timeouts or timeouts_lib.current()).replace(
            save_barrier=barrier_timeout_s, save=async_timeout_s, save_dead_after=dead_after_s)
        self.directory = os.path.abspath(os.fspath(directory))
        self.dead_after_s = self.timeouts.save_dead_after
        self.keep = keep
        self.process_id = jax.process_index() if process_id is None else process_id
        self.events = events or EventLog(None, self.process_id)
        self.barrier_timeout_s = self.timeouts.save_barrier
        self.async_timeout_s = self.timeouts.save
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointDirectoryError(f"checkpoint directory {self.directory} exists and is not a directory")
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise CheckpointDirectoryError(f"cannot create the checkpoint directory {self.directory} "
                                           f"({e.strerror or e})") from None
        orbax.set_barrier_timeout(self.barrier_timeout_s)
        orbax.private_signal_keys()
        self._current: _Save | None = None
        self._detached: list[_Save] = []
        self._canceller: deaths.Canceller | None = None  # cancels a save in its blocking phase on a recorded death

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(int(step)))

    # -- saving -------------------------------------------------------------------------
    def _manager(self, members: tuple[int, ...], prefix: str, cancel: threading.Event,
                 before_commit: Callable[[], None] | None, incarnations: Mapping[int, int] | None):
        barrier = orbax.SaveBarrier(f"{BARRIER_NAMESPACE}/{prefix}", members, self.process_id, cancel,
                                    timeouts=self.timeouts, lives=incarnations)
        mgr = orbax.save_manager(self.directory, members, prefix, keep=self.keep, barrier=barrier,
                                 async_timeout_s=self.async_timeout_s, before_commit=before_commit)
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
            if prev.digest == digest and not prev.wait(self.timeouts.save):
                # Orbax semantics: one save at a time per manager lineage; this one is stuck.
                prev.cancel.set()
                logger.warning("checkpoint %s still running after %s; abandoning it", prev.path,
                               self.timeouts.describe("save"))
                prev.wait(10.0)
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
            if not meta["checksum"]:  # publishing it would make a checkpoint every restore rejects
                raise CheckpointError(f"checkpoint {step}: the checksum could not be computed; not publishing")

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
            mgr, barrier = self._manager(members, prefix, cancel, before_commit, incarnations)
            # Orbax refuses zero-size arrays: they live in the layout (dtype, shape) only.
            item = {"step": named_step, "leaves": {n: a for n, a in named.items() if a.size}}
            with self._deaths_cancel(cancel, members, incarnations), orbax.blocking_barriers(barrier):
                mgr.save(step, args=orbax.save_args(item), custom_metadata=meta, force=True)
        except Exception as e:  # noqa: BLE001 - a failed save must not stop training
            cancel.set()
            checksum_done.set()
            if barrier is not None:
                barrier.abandon(_first_line(e))
            if mgr is not None:
                orbax.close_quietly(mgr)
            logger.info("checkpoint %s abandoned in its blocking phase: %s", self.step_path(step), _first_line(e))
            self.events.log(Event.CHECKPOINT_ABANDONED, step=step, path=self.step_path(step), reason=_first_line(e),
                            phase="blocking", processes=list(members))
            return None
        blocking_ms = round((time.perf_counter() - t0) * 1000, 2)
        self.events.log(Event.CHECKPOINT_STARTED, step=step, blocking_ms=blocking_ms, processes=list(members))
        if prev is not None and prev.digest == digest and me == members[0] and len(members) > 1:
            # Every member finished the previous save before this one's barriers passed.
            kv.delete_dir(f"{BARRIER_NAMESPACE}/{prev.prefix}")
        save = _Save(self, step, members, incarnations, digest, mgr, cancel, t0, blocking_ms, prefix, barrier)
        save.start()
        self._current = save
        return save

    @contextlib.contextmanager
    def _deaths_cancel(self, cancel: threading.Event, members: Sequence[int],
                       incarnations: Mapping[int, int] | None) -> Iterator[None]:
        """While inside (the blocking phase), ``cancel`` is set the moment the launcher records a
        member's death (:mod:`jaxft.worker.deaths`): the blocking barriers give up on it at once
        instead of after ``Timeouts.save_barrier``. Without records (another node, a host
        death) the save's barrier still gives up on the member once the heartbeat its life
        registered stops (``Timeouts.save_dead_after``, :mod:`jaxft.worker.lives`)."""
        others = [p for p in members if p != self.process_id]
        if not others or not incarnations:
            yield
            return
        if self._canceller is None:
            watch = deaths.DeathWatch()
            if not watch.state_dir:
                yield
                return
            self._canceller = deaths.Canceller(watch)
        self._canceller.watch.saw(incarnations)
        with self._canceller.during(cancel, others):
            yield

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
        """Wait (bounded, by default by ``Timeouts.save``) for saves in flight; abandon
        those that outlast ``timeout``."""
        timeout = self.async_timeout_s if timeout is None else timeout
        finished = self.wait(timeout)
        if not finished:
            logger.info("saves still in flight after %.0f s (%s): abandoning them", timeout,
                        self.timeouts.describe("save"))
            for s in self.in_flight():
                s.cancel.set()
            self.wait(10.0)
        return finished

    # -- restoring ----------------------------------------------------------------------
    def _reader(self):
        return orbax.read_manager(self.directory, self.process_id)

    def steps(self) -> list[int]:
        """Finalized (published) steps, oldest first. Each process reads on its own."""
        if not os.path.isdir(self.directory):
            return []
        mgr = self._reader()
        try:
            return sorted(int(s) for s in mgr.all_steps())
        finally:
            orbax.close_quietly(mgr)

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
            except Exception as e:
                raise CheckpointRejected(path, f"unreadable metadata: {_first_line(e)}") from e
            layout, names, empty = check_metadata(path, step, meta)
            try:
                item = mgr.restore(step, args=orbax.restore_args(names))[orbax.STATE_ITEM]
            except Exception as e:
                raise CheckpointRejected(path, f"read failed: {_first_line(e)}") from e
        finally:
            orbax.close_quietly(mgr)
        named = verified_leaves(path, step, meta, item, names, empty)
        tree: PyTree = named if template is None else _unflatten_like(template, layout, named, path)
        return Restored(step=int(step), path=path, tree=tree, metadata=meta)

    def restore_latest(self, template: PyTree | None = None, *, quarantine: bool = True) -> Restored | None:
        """Restore the newest checkpoint that verifies; reject (and move aside) broken ones.

        A checkpoint that vanishes while being read (deleted by ``max_to_keep`` on a live
        primary, or moved aside by a peer that rejected it first) is not reported as
        rejected: the directory is listed again instead, since a newer one may exist.
        """
        rejected: list[str] = []
        for _ in range(5):
            relist = False
            for step in reversed(self.steps()):
                path = self.step_path(step)
                t0 = time.perf_counter()
                try:
                    restored = self.restore(step, template)
                except CheckpointRejected as e:
                    if not os.path.isdir(path) or step not in self.steps():
                        relist = True  # deleted (max_to_keep) or moved aside by a peer while we read it
                        break
                    rejected.append(f"{step}: {e.reason}")
                    moved = self._quarantine(path) if quarantine else None
                    logger.info("checkpoint %s rejected (%s); moved to %s", path, e.reason, moved)
                    self.events.log(Event.CHECKPOINT_REJECTED, path=path, step=step, reason=e.reason, moved_to=moved)
                    continue
                self.events.log(Event.RESTORED, step=restored.step, path=path,
                                seconds=round(time.perf_counter() - t0, 4))
                return restored
            if not relist:
                break
        if rejected:
            raise CheckpointError(f"every checkpoint in {self.directory} was rejected ({'; '.join(rejected)}); "
                                  "refusing to start over from step 0. Move the directory aside to start fresh.")
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

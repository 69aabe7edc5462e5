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
``checkpoint_rejected``, ``restored``. A save in flight, and the watcher that logs how it
ended, is :mod:`~jaxft.worker.checkpoint.inflight`; the Orbax managers it saves and reads
with are built by :mod:`~jaxft.worker.checkpoint.managers`.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from jaxft.faults import FaultInjector
from jaxft.protocol import Event
from jaxft.timeouts import Timeouts
from jaxft.types import PyTree
from jaxft.worker import deaths, kv
from jaxft.worker.checkpoint import managers, orbax
from jaxft.worker.checkpoint.inflight import SaveKey, _Save, first_line
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
      timeouts: the waits (None: :func:`jaxft.timeouts.current`): ``save_barrier`` bounds every
        blocking Orbax barrier (all scoped to the save's live processes) and how long a save
        waits for a member that never reached any of its barriers; ``save`` bounds the
        background phase (writes and its barriers) of a save whose members all stay alive; a
        save member whose heartbeat stalls ``save_dead_after`` is dead.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3, events: EventLog | None = None,
                 process_id: int | None = None, timeouts: Timeouts | None = None, faults: FaultInjector | None = None):
        self.timeouts = timeouts or timeouts_lib.current()
        self.faults = faults  # (the ``before-publish`` fault point, in the save's background phase)
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep = keep
        self.process_id = jax.process_index() if process_id is None else process_id
        self.events = events or EventLog(None, self.process_id)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointDirectoryError(f"checkpoint directory {self.directory} exists and is not a directory")
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise CheckpointDirectoryError(f"cannot create the checkpoint directory {self.directory} "
                                           f"({e.strerror or e})") from None
        orbax.set_barrier_timeout(self.timeouts.save_barrier)
        orbax.private_signal_keys()
        self._current: _Save | None = None
        self._detached: list[_Save] = []
        self._canceller: deaths.Canceller | None = None  # cancels a save in its blocking phase on a recorded death

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(int(step)))

    # -- saving -------------------------------------------------------------------------
    def _manager(self, key: SaveKey, cancel: threading.Event, before_commit: Callable[[], None] | None):
        faults = self.faults
        written = None if faults is None else lambda: faults.point("before-publish", key.step)
        barrier = orbax.SaveBarrier(key.namespace, key.members, self.process_id, cancel,
                                    timeouts=self.timeouts, lives=key.incarnations, written=written)
        mgr = managers.save_manager(self.directory, key.members, key.prefix, keep=self.keep, barrier=barrier,
                                    async_timeout_s=self.timeouts.save, before_commit=before_commit)
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
        key = SaveKey.of(step, members, incarnations)
        self.notice_members(members, incarnations)
        prev = self._current
        self._current = None
        if prev is not None:
            if prev.digest == key.digest and not prev.wait(self.timeouts.save):
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
        mgr = barrier = None
        try:
            mgr, barrier = self._manager(key, cancel, before_commit)
            # Orbax refuses zero-size arrays: they live in the layout (dtype, shape) only.
            item = {"step": named_step, "leaves": {n: a for n, a in named.items() if a.size}}
            with self._deaths_cancel(cancel, members, incarnations), orbax.blocking_barriers(barrier):
                mgr.save(step, args=managers.save_args(item), custom_metadata=meta, force=True)
        except Exception as e:  # noqa: BLE001 - a failed save must not stop training
            cancel.set()
            checksum_done.set()
            if barrier is not None:
                barrier.abandon(first_line(e))
            if mgr is not None:
                orbax.close_quietly(mgr)
            logger.info("checkpoint %s abandoned in its blocking phase: %s", self.step_path(step), first_line(e))
            self.events.log(Event.CHECKPOINT_ABANDONED, step=step, path=self.step_path(step), reason=first_line(e),
                            phase="blocking", processes=list(members))
            return None
        blocking_ms = round((time.perf_counter() - t0) * 1000, 2)
        self.events.log(Event.CHECKPOINT_STARTED, step=step, blocking_ms=blocking_ms, processes=list(members))
        if prev is not None and prev.digest == key.digest and me == members[0] and len(members) > 1:
            # Every member finished the previous save before this one's barriers passed.
            kv.delete_dir(prev.key.namespace)
        save = _Save(self, key, mgr, barrier, cancel, t0, blocking_ms)
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
            if s is None or s.done.is_set() or s.cancel.is_set():
                continue
            lost = s.lost_members(members, incarnations)
            if lost:
                s.cancel.dead = lost  # type: ignore[attr-defined]  # named when its barrier gives up
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
        timeout = self.timeouts.save if timeout is None else timeout
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
        return managers.read_manager(self.directory, self.process_id)

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
                raise CheckpointRejected(path, f"unreadable metadata: {first_line(e)}") from e
            layout, names, empty = check_metadata(path, step, meta)
            try:
                item = mgr.restore(step, args=managers.restore_args(names))[managers.STATE_ITEM]
            except Exception as e:
                raise CheckpointRejected(path, f"read failed: {first_line(e)}") from e
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
                data = (restored.metadata.get("user") or {}).get("data") or {}  # ElasticCheckpointer's
                self.events.log(Event.RESTORED, step=restored.step, path=path, data_position=data.get("position"),
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

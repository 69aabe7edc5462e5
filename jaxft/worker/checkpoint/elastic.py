"""Checkpoints of an :class:`~jaxft.ElasticTrainer` or :class:`~jaxft.ElasticLoop`, and the
cold restart when every process dies.

Checkpoint ``N`` is the state after ``N`` committed steps (the loop's state pytree; for a
trainer, params and optimizer state).
The data position (``N * global_batch`` of the ``GlobalBatches`` permutation) and the
RNG are functions of ``N`` and the seeds recorded in the metadata, so nothing else is
saved. The state is replicated, so a run with another number of processes restores the
same checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from jaxft import protocol
from jaxft.errors import CheckpointDirectoryError, ConfigError, UncommittedSave
from jaxft.events import EventLog
from jaxft.protocol import Event
from jaxft.timeouts import Timeouts
from jaxft.worker import stopping
from jaxft.worker.checkpoint.inflight import _Save
from jaxft.worker.checkpoint.store import CheckpointStore, Restored
from jaxft.worker.options import CheckpointOptions


def _incarnations(record, trainer=None) -> dict[int, int] | None:
    """The agreed coordination-service incarnations of a commit's members (None if the
    record does not carry them; then save namespaces are keyed by members and step)."""
    given = record.incarnations
    if given and all(p in given for p in record.members):
        return {p: int(given[p]) for p in record.members}
    return None


def _loop(trainer):
    """The :class:`~jaxft.ElasticLoop` behind ``trainer`` (an ElasticTrainer, or the loop itself).
    An ElasticTrainer's loop state is ``{"params", "opt_state"}``: the checkpoint format."""
    trainer_pull = getattr(trainer, "_pull_view", None)
    if trainer_pull is not None:
        trainer_pull()
    return getattr(trainer, "loop", trainer)


def check_every(every: int, loop) -> None:
    """Refuse a checkpoint interval the loop's commits never land on: ``on_commit`` runs once
    per commit, at multiples of ``commit_every``, so the other saves would silently not happen.
    A :class:`ConfigError` (exit 78): a restart would only repeat it."""
    if loop.options.auto_commit:  # (each save's step commits alone: ElasticCheckpointer._fit_commits)
        return
    n = int(loop.options.commit_every)
    if every and every % n:
        raise ConfigError(f"ElasticCheckpointer every={every} is not a multiple of the loop's commit_every={n}: "
                          "on_commit runs once per commit, so saves between two commits would never happen")


def check_committed(loop) -> None:
    """Refuse to save steps run but not committed yet (``commit_every``): they may be undone."""
    pending = getattr(loop, "pending", 0)
    if pending:
        raise UncommittedSave(f"save() at step {loop.step}: its last {pending} steps are not committed yet "
                              f"(commit_every={loop.options.commit_every}) and may be undone; save from on_commit or "
                              "after run()")


def resolve_directory(directory: str | os.PathLike | None, environ=os.environ) -> str:
    """``directory``, or ``$JAXFT_RUN_DIR/checkpoints`` (set by ``jaxft launch --run-dir``)."""
    if directory is not None:
        return os.fspath(directory)
    run_dir = environ.get(protocol.RUN_DIR)
    if not run_dir:
        raise CheckpointDirectoryError("checkpointing needs a directory: pass one, or run under "
                         "jaxft launch --run-dir (which sets $JAXFT_RUN_DIR)")
    return os.path.join(run_dir, "checkpoints")


class ElasticCheckpointer:
    """Checkpoints an :class:`~jaxft.ElasticTrainer` (or :class:`~jaxft.ElasticLoop`).

    Usage::

        ckpt = ElasticCheckpointer(directory, runtime=rt, data=data,
                                   options=CheckpointOptions(every=5, keep=3))
        trainer = ElasticTrainer(..., on_commit=ckpt.on_commit)   # or call it from yours
        ckpt.restore(trainer)           # before training: cold restore if a checkpoint exists
        trainer.run(num_steps)
        ckpt.close()                    # wait for the last save

    Checkpoint ``N`` holds the state after ``N`` committed steps (``trainer.state.step``),
    so it is saved at the commit of step index ``N - 1``. The fault point
    ``during-save`` fires with ``N`` right after the save started and before it completes.

    Args:
      directory: the checkpoint root.
      runtime: what :func:`jaxft.initialize` returned (events, fault points and timeouts).
      data: the :class:`~jaxft.GlobalBatches` (its seed and sizes go into the metadata; a
        restore with other ones logs ``checkpoint_data_mismatch``).
      options: :class:`~jaxft.CheckpointOptions` (how often, how many kept, metadata).
      timeouts: the save's waits (None: the runtime's, else :func:`jaxft.timeouts.current`).
    """

    def __init__(self, directory: str | os.PathLike, *, runtime=None, data=None,
                 options: CheckpointOptions = CheckpointOptions(), timeouts: Timeouts | None = None):
        self.options = options
        self.every = options.every
        self.faults = runtime.faults if runtime is not None else None
        timeouts = timeouts or (runtime.timeouts if runtime is not None else None)
        self.store = CheckpointStore(directory, keep=options.keep,
                                     events=runtime.events if runtime is not None else None, timeouts=timeouts,
                                     faults=self.faults)
        self.events: EventLog = self.store.events
        self.metadata = dict(options.metadata or {})
        if data is not None:  # data order and position are functions of (seed, step) here
            self.metadata.setdefault("data", {"seed": int(data.seed), "global_batch": int(data.global_batch),
                                              "num_examples": int(data.num_examples),
                                              "shuffle": bool(getattr(data, "shuffle", True))})
        self.restored: Restored | None = None
        self._last_record = None
        self._fitted: set[int] = set()  # ids of the loops whose commits land on every save's step

    @property
    def directory(self) -> str:
        return self.store.directory

    def restore(self, trainer) -> Restored | None:
        """Cold restore into ``trainer`` (before training); None if there is no usable checkpoint.

        A restarted process whose peers train on (``jaxft launch`` says one may, and the
        members' list is published; ready admission) would throw the checkpoint away for a
        live member's newer state when it is admitted: it does not read it (the
        ``restore_deferred`` event; returns None), and restores only if its first step turns
        out to be a cold start after all (every member died while it set up, or before)."""
        loop = _loop(trainer)
        self._fit_commits(loop)  # before training: not at the first commit
        if self._peers_train_on(loop):
            self.events.log(Event.RESTORE_DEFERRED, step=loop.step)
            loop.group.on_cold_start(lambda: self._restore(loop))
            if self.faults is not None:
                self.faults.point("restore-deferred", loop.step)
            self.restored = None
            return None
        return self._restore(loop)

    def _fit_commits(self, loop) -> None:
        """Make the loop's commits land on every save's step: a fixed ``commit_every`` must
        divide ``every`` (:func:`check_every`); with ``"auto"``, each such step commits alone."""
        check_every(self.every, loop)
        if self.every and loop.options.auto_commit and id(loop) not in self._fitted:
            self._fitted.add(id(loop))
            loop.commit_alone_at(lambda step, every=self.every: step % every == 0)

    def _peers_train_on(self, loop) -> bool:
        """A restart that ready admission will bring into a running set of members."""
        group = loop.group
        return bool(group.peers_may_run) and group.admission == "ready" and group.members_listed()

    def _restore(self, loop) -> Restored | None:
        restored = self.store.restore_latest(loop.state)
        if restored is not None:
            if self.faults is not None:
                self.faults.point("during-restore", restored.step)
            loop.restore(restored.step, restored.tree)
            saved_data = dict((restored.metadata.get("user") or {}).get("data") or {})
            saved_data.pop("position", None)
            if saved_data and "data" in self.metadata and saved_data != self.metadata["data"]:
                self.events.log(Event.CHECKPOINT_DATA_MISMATCH, step=restored.step, saved=saved_data,
                                current=self.metadata["data"])
        self.restored = restored
        return restored

    def on_commit(self, trainer, record) -> None:
        """The trainer hook: abandon saves waiting on dead members; save every ``every`` steps."""
        self._fit_commits(_loop(trainer))  # (restore() did, if it was called)
        self._last_record = record
        incs = _incarnations(record, trainer)
        self.store.notice_members(record.members, incs)
        self.store.poll()
        step = _loop(trainer).step
        stop_at = stopping.stop_step(step)
        if stop_at is not None and step >= stop_at:  # a clean stop: a last checkpoint, written out
            self.save(trainer, record, incarnations=incs)
            with _loop(trainer).group.busy():
                self.close()
        elif self.every and step % self.every == 0:
            self.save(trainer, record, incarnations=incs)

    def save(self, trainer, record=None, *, incarnations: Mapping[int, int] | None = None) -> _Save | None:
        """Save the committed state now (on demand), as checkpoint ``trainer.state.step``.

        Like any collective, every member of the commit (``record``, by default the last
        one :meth:`on_commit` saw) must call it at the same commit: from ``on_commit``
        with a condition that depends on the step only, or after ``trainer.run`` returns.
        Returns once the host snapshot is taken; the write goes on in the background.
        Raises :class:`~jaxft.errors.UncommittedSave` while steps are pending (``commit_every``).
        """
        loop = _loop(trainer)
        check_committed(loop)
        record = record if record is not None else self._last_record
        if record is None:
            raise ValueError("save() needs the StepRecord of the commit to save (no commit seen yet)")
        step = int(loop.step)
        incs = incarnations if incarnations is not None else _incarnations(record, trainer)
        meta = dict(self.metadata)
        if "data" in meta:
            meta["data"] = dict(meta["data"], position=step * meta["data"]["global_batch"])
        meta["rng"] = "parameters and data order derive from the seeds above and the step"
        meta["members"] = list(record.members)
        if self.faults is not None:  # the others start this save's blocking phase without this process
            self.faults.point("before-save", step)
        with loop.group.busy():  # its barriers wait for every member: not a hang (jaxft.worker.hang)
            save = self.store.save(step, loop.state, members=record.members,
                                   incarnations=incs, metadata=meta)
        if self.faults is not None:
            self.faults.point("during-save", step)
        return save

    def close(self, timeout: float | None = None) -> bool:
        """Wait for the saves in flight (bounded); call once training is over."""
        return self.store.close(timeout)

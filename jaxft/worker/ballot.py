"""This member's votes for a step's program (:mod:`jaxft.core.votes`), as the program's input.

A member votes the joiners it saw ready (held while a program it left still runs, and at its
run's last step), whether it could build its inputs, and its own conditions for what follows
the step (:func:`jaxft.core.step.own_votes`): whether the next step may start early and whether
this step may leave its commit to a later one.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from jaxft.core import batching
from jaxft.core import step as step_core
from jaxft.core import votes as votes_lib
from jaxft.events import EventLog
from jaxft.faults import FaultInjector
from jaxft.protocol import Event
from jaxft.types import PyTree
from jaxft.worker import admission as admission_lib
from jaxft.worker import stopping
from jaxft.worker.members import Members
from jaxft.worker.membership import ElasticGroup
from jaxft.worker.options import LoopOptions
from jaxft.worker.programs import votes_array

R = TypeVar("R")


def on_the_step_clock(try_step: Callable[[Any], R]) -> Callable[[Any], R]:
    """A loop's ``try_step``, timed for its commit batcher (``loop.executor.ballot.batcher``):
    what the caller does between attempts is not a step's cost
    (:meth:`jaxft.core.batching.CommitBatcher.entered`)."""

    @functools.wraps(try_step)
    def timed(loop: Any) -> R:
        batcher = loop.executor.ballot.batcher
        batcher.entered(time.monotonic())
        try:
            return try_step(loop)
        finally:
            batcher.left(time.monotonic())

    return timed


class Ballot:
    """One loop's votes (see the module docstring)."""

    def __init__(self, group: ElasticGroup, options: LoopOptions, events: EventLog, faults: FaultInjector,
                 left_running: Callable[[], bool]):
        self.group, self.options, self.events, self.faults = group, options, events, faults
        self._left_running = left_running  # a step program this member left still runs
        self._holding = False  # this member holds admissions back (see _hold_if_left)
        self._array: tuple | None = None  # ((device ids, vote bytes), global votes array)
        # commit_every="auto": this member's batch size (its memory check once the state is known)
        self.batcher = batching.CommitBatcher(time.monotonic())
        self.pending: Callable[[], int] = lambda: 0  # steps run since the last commit (set by the loop)
        self.commit_at: list[Callable[[int], bool]] = []  # step counts that must be committed alone
        self._memory_checked = False

    def forget(self) -> None:
        """Before a backend rebuild: the placed votes belong to the old backend."""
        self._array = None

    def input(self, m: Members, step: int, fail: bool = False) -> jax.Array:
        """This member's vote row for the program of step ``step`` as the ``[D, W]`` input of the
        program that sums it (``fail``: it runs on placeholders). Its run's end is its own: a
        member whose run ends at this step (a restart catching up in an earlier ``run()``) makes
        every member commit, admit nobody and start nothing early, as they all would at their own
        last step."""
        admission = self._hold_if_left(self.group.votes(m), m, step)
        o, full = self.options, None
        if o.auto_commit:  # (a step where a fault rule of this member may fire commits alone, as the one before)
            full = (self.batcher.commit_now(self.pending(), time.monotonic())
                    or any(f(step + 1) for f in self.commit_at) or not self.faults.quiet_at(step))
        own = step_core.own_votes(step, self.group.target, pipeline=o.pipeline,
                                  next_quiet=self.faults.quiet_at(step + 1),
                                  commit_every=1 if o.auto_commit else int(o.commit_every),
                                  stop_requested=stopping.requested(), batch_full=full)
        if own.hold:  # no admission after the run's last step
            admission = admission_lib.held(admission, m.process_ids)
        row = votes_lib.row(admission, step, fail=fail, not_ahead=own.not_ahead, commit=own.commit)
        key = (tuple(d.id for d in m.devices), row.tobytes())
        if self._array is None or self._array[0] != key:
            self._array = (key, votes_array(row, m.mesh, self.group.axis_name))
        return self._array[1]

    def ran(self, state: PyTree) -> None:
        """A step's program just ended (``commit_every="auto"``; the first one checks whether one
        more copy of ``state`` is cheap on the devices, see :mod:`jaxft.core.batching`)."""
        if not self.options.auto_commit:
            return
        if not self._memory_checked:
            self._memory_checked = True
            size = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state))
            self.batcher.memory_ok = batching.memory_allows(size, _device_bytes_limit())
        self.batcher.ran(time.monotonic())

    def _hold_if_left(self, votes: np.ndarray, m: Members, step: int) -> np.ndarray:
        """``votes``, held (:func:`jaxft.worker.admission.held`) while a step program this member
        left still runs: an admission's rebuild would wait for that program (up to the collective
        timeout) with every member; held, they go on at their width."""
        if not self._left_running():
            self._holding = False
            return votes
        ready = [p for p, v in enumerate(votes) if v == admission_lib.READY]
        if ready and not self._holding:
            self._holding = True
            self.events.log(Event.ADMISSION_HELD, step=step, joiners=ready)
        return admission_lib.held(votes, m.process_ids)


def _device_bytes_limit() -> int | None:
    """The first local device's memory in bytes, or None where it does not say (CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None

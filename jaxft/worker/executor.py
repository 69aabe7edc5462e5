"""The device side of a loop's steps: one attempt's program on the members' devices.

:class:`Executor` puts together what runs a step's program: the program per mesh
(:mod:`~jaxft.worker.programs`), the placed batch (:mod:`~jaxft.worker.feeding`), this member's
votes (:mod:`~jaxft.worker.ballot`), the thread a program can be left in
(:mod:`~jaxft.worker.runner`), the next step's program started early
(:mod:`~jaxft.worker.pipeline`), and the replicated state of the last step, reused while the
members and the state stay the same (no copy to the devices in steady state).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxft.core import spares as spares_core
from jaxft.core import votes as votes_lib
from jaxft.events import EventLog
from jaxft.faults import FaultInjector
from jaxft.protocol import EXIT_HUNG, Event
from jaxft.types import PyTree
from jaxft.worker import runner as runner_lib
from jaxft.worker.arrays import replicate
from jaxft.worker.ballot import Ballot
from jaxft.worker.feeding import BatchFeeder
from jaxft.worker.members import Members
from jaxft.worker.membership import ElasticGroup
from jaxft.worker.options import Batching, LoopOptions, MeshStep
from jaxft.worker.pipeline import Pipeline
from jaxft.worker.programs import Programs, StepFn

logger = logging.getLogger(__name__)


class Executor:
    """Runs one loop's step programs (see the module docstring).

    Args:
      step: the user's step, or a :class:`~jaxft.MeshStep`.
      data: the global batches.
      group: the loop's :class:`~jaxft.ElasticGroup`.
      options, batching: the loop's.
      events, faults: the loop's event log and fault points.
      state: the loop's current state (for the reference program and the warm-up).
    """

    def __init__(self, step: StepFn | MeshStep, data, group: ElasticGroup, options: LoopOptions,
                 batching: Batching, events: EventLog, faults: FaultInjector, state: Callable[[], PyTree]):
        pid, axis = group.process_id, group.axis_name
        self.group, self.events, self.faults = group, events, faults
        self.runner = runner_lib.StepRunner()
        self.feeder = BatchFeeder(data, batching, axis, pid)
        self.programs = Programs(step, process_id=pid, axis_name=axis, batching=batching, voting=self.voting,
                                 precompile=bool(options.precompile) or group.width is not None, state=state,
                                 template=lambda: self.feeder.template)
        self.ballot = Ballot(group, options, events, faults, self.runner.pending)
        self.pipeline = Pipeline(self.runner, pid, lambda: group.data_plane.needs_reset and jax.process_count() > 1)
        # The last step's replicated outputs: (device ids, ids of the local leaves, global state)
        self._global: tuple | None = None

    def admit(self, m: Members, verdict: votes_lib.Verdict, step: int, **fields: Any) -> None:
        """Admit the joiners the members agreed on; they enter at ``step`` (``admit`` event; with
        spares it names the width, and ``before_step`` when the members left a step for them)."""
        admitted = self.group.admit(m, verdict.admission)
        if admitted:
            if self.group.width is not None:
                fields["width"] = self.group.width
            self.events.log(Event.ADMIT, step=step, joiners=list(admitted), **fields)
            self.faults.point("admitting", step)

    def voting(self) -> bool:
        """Whether the programs carry the admission votes (ready admission)."""
        return self.group.admission == "ready"

    # -- the replicated state ---------------------------------------------------------
    def remember(self, m: Members, state: PyTree, new_global: PyTree) -> None:
        """``state`` (the local copy of ``new_global``) is now the loop's: reuse ``new_global``."""
        self._global = (tuple(d.id for d in m.devices), jax.tree_util.tree_leaves(state), new_global)

    @property
    def remembered(self) -> tuple | None:
        return self._global

    def recall(self, remembered: tuple | None) -> None:
        """Go back to an earlier :attr:`remembered` (a roll-back), or forget (None)."""
        self._global = remembered

    def last_output(self, state: PyTree, m: Members) -> PyTree | None:
        """The last step's replicated output if ``state`` is still its local copy on ``m``'s devices."""
        g = self._global
        leaves = jax.tree_util.tree_leaves(state)
        if (g is not None and g[0] == tuple(d.id for d in m.devices) and len(g[1]) == len(leaves)
                and all(a is b for a, b in zip(g[1], leaves))):
            return g[2]
        return None

    def replicated(self, state: PyTree, m: Members) -> PyTree:
        """``state`` on ``m``'s devices, replicated (reused from the last step where it can be)."""
        g = self.last_output(state, m)
        return g if g is not None else replicate(state, m.mesh)

    def to_host(self) -> None:
        """Before a backend rebuild: every placed array belongs to the old backend."""
        self._global = None
        self.ballot.forget()
        self.feeder.forget()

    # -- programs ---------------------------------------------------------------------
    def run(self, step: int, state: PyTree, m: Members) -> tuple[PyTree, tuple, Exception | None]:
        """Step ``step``'s program on ``m`` from ``state``: ``(new global state, host outputs (the
        metrics, and the agreed votes when voting), this member's error building its inputs)``.
        A member that cannot build its inputs still runs it, on placeholders, voting ``fail``."""
        fn = self.programs.for_mesh(m.mesh)
        voting = self.voting()
        (batch, mask), local_error = self.feeder.inputs(step, m.mesh, voting)
        args: tuple = (self.replicated(state, m), batch, mask)
        if voting:  # the votes ride in the step's own program
            args += (self.ballot.input(m, step, fail=local_error is not None),)
        # in a thread it can be left in (jaxft.worker.runner)
        new_global, host = self.runner.run(self._job(step, m, fn, args))
        self.programs.check_contract(fn, args[0], new_global)
        return new_global, host, local_error

    def start_ahead(self, step: int, m: Members, inputs: PyTree) -> None:
        """Start step ``step``'s program on this step's output (see ``LoopOptions.pipeline``). If
        this member cannot build its inputs, the program still starts, on placeholders and with
        a ``fail`` vote, since the others started theirs: the step then fails everywhere."""
        fn = self.programs.for_mesh(m.mesh)
        (batch, mask), error = self.feeder.inputs(step, m.mesh, True)
        args = (inputs, batch, mask, self.ballot.input(m, step, fail=error is not None))
        self.pipeline.start(step, m.mesh, inputs, self._job(step, m, fn, args, fault_point=False), error)

    def votes_alone(self, m: Members, step: int) -> votes_lib.Verdict:
        """With too few members to commit (``min_members``), the votes alone, summed by a program
        of their own: the joiners they wait for are admitted as at a commit."""
        fn, votes = self.programs.votes_only(m.mesh), self.ballot.input(m, step)
        out = self.runner.run(lambda: jax.block_until_ready(fn(votes)))
        return votes_lib.read(np.asarray(out.addressable_data(0)), len(m.devices))

    def spare_first(self, m: Members, step: int) -> votes_lib.Verdict | None:
        """With spares, below the width (alike on every member: ``m`` is agreed): the votes
        alone, if they admit a spare, which then enters before any step commits without it
        (:mod:`jaxft.core.spares`); else None, and the step runs at the members' width."""
        width = self.group.width
        if not spares_core.swap_first(m.process_ids, width):
            return None
        alone = self.votes_alone(m, step)
        return alone if spares_core.to_admit(alone.admission, m.process_ids, width) else None

    def take_spares(self, m: Members | None, step: int) -> None:
        """After step ``step`` over ``m`` failed: the survivors take ready spares in at once,
        unless this member holds admissions (a step program it left still runs)."""
        spares = self.group.spares_after_failure(m.incarnations, self.runner.pending()) if m is not None else ()
        if spares:
            self.events.log(Event.ADMIT, step=step, joiners=list(spares), width=self.group.width, after_failure=True)

    def _job(self, step: int, m: Members, fn: Callable, args: tuple, fault_point: bool = True) -> Callable:
        """The step runner's job for step ``step``: its fault point, then its program."""
        def before() -> bool:
            if fault_point:
                self.faults.point("in-step", step)
            return self.runner.left()  # (left during the fault point's hang, or before it began)

        return self.programs.job(m.mesh, fn, args, before=before, on_cpu=self.group.data_plane.platform == "cpu")

    def log_rebuild(self, step: int, seconds: float) -> None:
        """Where a recovery's time went: the rebuild's parts, then the step's program (compiled or
        loaded, :mod:`jaxft.worker.executables`) in ``seconds`` (the ``data_plane`` event)."""
        ex = self.programs.executables
        self.events.log(Event.DATA_PLANE, step=step, program_s=round(seconds, 4), **self.group.data_plane.last_reset,
                        programs_loaded=ex.loads, programs_compiled=ex.compiles)

    # -- programs left behind ---------------------------------------------------------
    def abandon(self, info: dict[str, Any], step: int) -> bool:
        """From the hang monitor: leave the doomed step's program (see jaxft.worker.runner)."""
        if not self.runner.abandon(info["phase"]):
            return False
        self.events.log(Event.ABANDONED, step=step, **info)
        return True

    def drain(self) -> None:
        """Before a backend rebuild: wait for step programs this process left (an abandoned one
        ends when gloo's collective timeout fires); exit to rejoin past that bound."""
        self.pipeline.settle(drop=True)  # (a step started ahead: only defensively, the members did not change)
        bound = self.group.timeouts.collective + 2.0
        if not self.runner.drain(bound):
            logger.error("process %d: a step program it left is still running after %.0f s; exiting to rejoin",
                         self.group.process_id, bound)
            os._exit(EXIT_HUNG)

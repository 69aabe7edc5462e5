"""``ElasticLoop``: bring your own jitted train step and state pytree; jaxft makes it elastic.

The layer between :class:`~jaxft.ElasticGroup` (the atomic step) and
:class:`~jaxft.ElasticTrainer` (loss function + optax). You keep your step function and
your state (a flax ``TrainState``, a dict of params and optimizer state, anything that is a
pytree of arrays); jaxft runs each step inside one atomic block and handles the rest:

* the mesh over the live devices (1-D, axis ``group.axis_name``, default ``"data"``), and a
  jitted copy of your step per member set, with the new state replicated;
* the global batch: step ``k`` always gets the same ``G`` examples from ``data``
  (:class:`~jaxft.GlobalBatches` or :class:`~jaxft.GrainBatches`), split over the members,
  padded to a multiple of the device count with copies of example 0 (real inputs, never
  zeros: a loss that is NaN on zeros cannot poison the masked sum), with a mask (1 = real
  example, 0 = padding). Anything your model computes over the batch dimension sees the
  padding rows too (batch-norm statistics, a mean inside the model): weight such statistics
  by the mask, or pick ``G`` a multiple of every device count the run may have;
* the retry: a step that a member did not finish is retried on the survivors with the same
  batch; nothing is committed anywhere until every member finished;
* the rejoin: a restarted process receives the step and state, bit for bit, from a donor;
* the hooks: ``on_commit(loop, record)`` after every commit (checkpoints, logging).

Your step: ``step(state, batch, mask) -> (new_state, metrics)``, where ``batch`` is the
global batch pytree ``[P, ...]`` sharded over the members (``P >= G``, padding masked out by
``mask [P]``; :class:`~jaxft.Batching` for micro-batches) and ``metrics`` a dict of scalars (a
``"loss"`` entry is logged with each commit). It must not donate its input state and must
return a replicated state (both checked once, configuration errors otherwise).
Normalise by the global batch size ``G`` (``loop.global_batch``), never by ``P`` or the number
of devices, so a step computes the same whoever is alive::

    def step_fn(state, batch, mask):
        def loss_fn(params):
            per_example = ...                              # [P]
            return jnp.sum(per_example * mask) / G
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    loop = jaxft.ElasticLoop(step_fn, state, data, runtime=rt, options=jaxft.LoopOptions(check_every=10))
    state = loop.run(num_steps)

The pieces: the step's program per mesh (:mod:`~jaxft.worker.programs`), the batch
(:mod:`~jaxft.worker.feeding`), this member's votes (:mod:`~jaxft.worker.ballot`), the early
program (:mod:`~jaxft.worker.pipeline`), the steps not committed yet (:mod:`~jaxft.worker.commits`),
the warm-up (:mod:`~jaxft.worker.warmup`) and the state's agreement (:mod:`~jaxft.worker.rejoin`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from jaxft.core import retry as retry_core
from jaxft.core import step as step_core
from jaxft.errors import ConsistencyError, RetryBudgetExceeded, StepFailed, TooFewMembers
from jaxft.events import EventLog
from jaxft.faults import FaultInjector
from jaxft.protocol import EXIT_HUNG, EXIT_STOPPED, Event
from jaxft.types import PyTree
from jaxft.worker import rejoin, stopping, transfer
from jaxft.worker import runner as runner_lib
from jaxft.worker.arrays import canonical, local_copy, scalars, to_host
from jaxft.worker.attempts import Desync, Ran, Reached, Skip, StepRecord, VotedFail, final_fields, read_outputs
from jaxft.worker.ballot import on_the_step_clock
from jaxft.worker.commits import PendingCommits
from jaxft.worker.executor import Executor
from jaxft.worker.members import Members
from jaxft.worker.membership import ElasticGroup
from jaxft.worker.options import Batching, LoopOptions, MeshStep
from jaxft.worker.programs import StepFn
from jaxft.worker.warmup import Precompiler

if TYPE_CHECKING:
    from jaxft.worker.data import BatchSource
    from jaxft.worker.runtime import Runtime

logger = logging.getLogger(__name__)


class ElasticLoop:
    """Runs your step elastically (see the module docstring).

    Args:
      step: ``(state, batch, mask) -> (new_state, metrics)``, jitted here once per member set
        with replicated outputs (an already-jitted function is fine); or a
        :class:`~jaxft.MeshStep` that builds the step for each mesh.
      state: the initial state pytree (every process must pass the same values). Prefer host
        copies (``jax.tree_util.tree_map(np.array, state)``) and keep no jax array of it alive
        in your program: on CPU a rejoin rebuilds the backend, and arrays of the old one that
        stay referenced keep its memory (a ``backend_leaked`` event says so).
      data: maps a step to its global batch: ``.batch(step)`` and ``.global_batch``.
      runtime: what :func:`jaxft.initialize` returned (events and fault points).
      on_commit: ``(loop, record)`` after every commit (with ``commit_every``, once per commit,
        for its last step). Between commits, :attr:`step` and :attr:`state` are those of the last
        step run; :attr:`pending` says how many of them are not committed yet.
      options: :class:`~jaxft.LoopOptions` (retries, admission, pipeline, commit batching,
        checks, warm-up).
      batching: :class:`~jaxft.Batching` (how the step gets its batch).

    The loop's :class:`~jaxft.ElasticGroup` is :attr:`group`.
    """

    def __init__(self, step: StepFn | MeshStep, state: PyTree, data: BatchSource, *,
                 runtime: Runtime | None = None, on_commit: Callable[[Any, StepRecord], None] | None = None,
                 options: LoopOptions = LoopOptions(), batching: Batching = Batching()):
        self.options, self.data, self.on_commit = options, data, on_commit
        batching = batching if batching.stacked else dataclasses.replace(batching, chunk=None)
        self.events: EventLog = runtime.events if runtime is not None else EventLog(None, jax.process_index())
        self.faults: FaultInjector = (runtime.faults if runtime is not None
                                      else FaultInjector([], jax.process_index()))
        self.group = ElasticGroup(admission=options.admission, timeouts=runtime.timeouts if runtime else None)
        self.step = 0  # steps committed (or run, with commit_every: see pending)
        self.state = canonical(state)
        self.last_metrics: dict[str, float] = {}
        self._too_few: tuple[int, ...] | None = None
        self._took_spare = False  # the last attempt left its step to take a spare in first
        self._last_failure, self._resync = "", False  # (_resync: the members ran different steps)
        self._in_step = 0  # the step the attempt in progress runs (for the in-commit fault point)
        self._leaks_logged = 0
        self.executor = Executor(step, data, self.group, options, batching, self.events, self.faults,
                                 lambda: self.state)
        self.commits = PendingCommits()
        self.executor.ballot.pending = lambda: len(self.commits)  # (commit_every="auto": a member's batch)
        self.precompiler = Precompiler(self.executor.programs, self.executor.feeder, self.group, self.events,
                                       options.precompile, options.retry.min_members)
        self.sync = rejoin.StateSync(self.group, self.events, self.faults)
        self.group.on_reset(before=self.executor.drain)  # first: nothing may run under the rebuild
        self.group.on_reset(before=self._state_to_host, after=self.executor.programs.reset)
        self.group.on_reset(before=transfer.forget_programs)  # (they hold the old backend's meshes)
        self.group.on_reset(during=lambda: self.faults.point("during-rebuild", self._in_step))  # (any sync)
        self.group.before_admission(lambda pids: self.sync.check_before_admission(self.state), may_raise=True)
        self.group.before_admission(lambda pids: self.precompiler.before_admission(pids, self.step, self.state))
        self.group.before_admission(lambda pids: self.precompiler.as_spare(pids, self.step, self.state), spare=True)
        self.group.before_admission(lambda pids: self.faults.point("ready", self.step), announced=True)
        self.group.on_exit_query(lambda: self.faults.point_soon("in-commit", self._in_step))

    @property
    def global_batch(self) -> int:
        return self.executor.feeder.global_batch

    @property
    def last_loss(self) -> float | None:
        return self.last_metrics.get("loss")

    @property
    def pending(self) -> int:
        """Steps run since the last commit, committed by the next one or undone (``commit_every``)."""
        return len(self.commits)

    def restore(self, step: int, state: PyTree) -> None:
        """Continue from ``(step, state)`` (e.g. a checkpoint) instead of the initial state."""
        self.commits.clear()
        self.step, self.state = int(step), canonical(state)
        self.executor.recall(None)

    # -- around a backend rebuild -------------------------------------------------------
    def _state_to_host(self) -> None:
        self._roll_back("the backend is rebuilt")  # (never with steps pending: they commit or fail first)
        self.executor.to_host()  # (arrays of the backend a rebuild replaces)
        self.state = to_host(self.state)

    def _roll_back(self, why: str) -> None:
        """Undo the steps run since the last commit: a later step of that commit failed."""
        undone = self.commits.roll_back()
        if undone is not None:
            (self.step, self.state, remembered), steps = undone
            self.executor.recall(remembered)
            self.events.log(Event.ROLLED_BACK, step=self.step, steps=steps, why=why)

    # -- the loop -----------------------------------------------------------------------
    def run(self, num_steps: int, before_attempt: Callable[[], None] | None = None) -> PyTree:
        """Run until ``num_steps`` steps are committed; returns the final state.

        ``run(20); run(80)`` trains steps 0-19, then 20-79. A process restarted while its peers
        are in a later ``run()`` is rehydrated at their step (each earlier ``run()`` returns at
        once); one that starts after they finished the job's last run exits 0. See
        :class:`~jaxft.RetryPolicy` for when it gives up (``before_attempt``: called first)."""
        run = self.group.begin_run(num_steps)
        if run.finished:  # restarted after the others finished: never train on alone
            self.events.log(Event.RUN_ALREADY_FINISHED, step=self.step, target=num_steps, run=run.index)
            logger.info("process %d: the others already finished this run; exiting 0", self.group.process_id)
            raise SystemExit(0)
        self.group.hang.watch(on_hung=lambda info: self.events.log(Event.HUNG, step=self.step, **info),
                              abandon=lambda info: self.executor.abandon(info, self.step))
        self.events.log(Event.TRAIN_START, step=self.step, total_steps=num_steps, run=run.index,
                        **({"catching_up": True} if run.passed else {}))
        retry, timeouts = self.options.retry, self.group.timeouts
        budget = retry_core.RetryBudget(retry.max_attempts, timeouts.barrier, at_step=self.step)
        while self.step < num_steps:
            if before_attempt is not None:
                before_attempt()
            if self.try_step() is not None:
                budget.committed(self.step)
                stop_at = stopping.stop_step(self.step)
                if stop_at is not None and self.step >= stop_at:  # on_commit saved it if asked to
                    self.executor.pipeline.settle(drop=True)  # (every member stops here: all end the early program)
                    self.events.log(Event.STOPPED, step=self.step)
                    raise SystemExit(EXIT_STOPPED)
            elif self.pending:  # run, its commit left to a later step's (commit_every)
                budget.pending()
            elif self._took_spare:  # nothing failed: the next step has a spare in it
                pass
            elif self._too_few is not None:  # nothing failed: too few members to commit
                if budget.too_few(time.monotonic()) is not None:
                    raise TooFewMembers(f"only processes {list(self._too_few)} are alive, fewer than min_members="
                                        f"{retry.min_members}, for {timeouts.describe('barrier')}")
                time.sleep(self.group.hang.poll_s)
            elif (give_up := budget.failed(self.step)) is not None:
                raise RetryBudgetExceeded(f"step {self.step} failed {give_up.failures} times in a row "
                                          f"(max_attempts={retry.max_attempts}); last: {self._last_failure}")
        self.executor.pipeline.settle(drop=True)  # (none is started for the last step)
        self.group.finish(self.step)
        while self._leaks_logged < self.group.data_plane.leaked_backends:  # (counted by finish)
            self._leaks_logged += 1
            self.events.log(Event.BACKEND_LEAKED, step=self.step)
        self.log_final()
        return self.state

    @on_the_step_clock
    def try_step(self) -> StepRecord | None:
        """One attempt at the next step: the record of the commit it made, or None if it made
        none (it failed; or, with ``commit_every``, it ran and its commit is left to a later step)."""
        step = self._in_step = self.step
        self._too_few, self._took_spare = None, False
        self.faults.point("before-step", step)
        m: Members | None = None
        try:
            with self.group.step() as m:
                ran = self._attempt(step, m)
        except StepFailed as e:
            self.executor.pipeline.leave(f"step {step} did not commit")
            self.executor.take_spares(m, step)  # (they enter the retry: no step commits without them)
            seen: dict[str, Any] = {"noticed": {str(p): why for p, why in e.noticed.items()}} if e.noticed else {}
            return self._failed(step, str(e), failed=sorted(e.failed),
                                cause=str(e.cause).splitlines()[0][:300] if e.cause else "membership changed", **seen)
        except VotedFail as e:  # a member could not build its inputs: every member fails the step
            return self._failed(step, e.why, failed=[], cause=e.why.splitlines()[0][:300], own=e.error is not None)
        except Desync:  # the members ran different steps: the ones behind are brought forward
            self._resync = True
            assert m is not None
            self.events.log(Event.DESYNC, step=step, members=list(m.process_ids))
            logger.warning("process %d: the members ran different steps (this one: %d); the step fails and the "
                           "next one brings every member to the latest committed step", self.group.process_id, step)
            return self._failed(step, "the members ran different steps", log=False)
        except rejoin.Refused as e:  # a joiner's state does not match the members': it leaves, they go on
            self._last_failure = str(e)
            self.events.log(Event.STEP_FAILED, step=step, failed=list(e.processes), cause=str(e))
            return None
        except runner_lib.Abandoned as e:  # left a program no member failed in: the others may commit it
            self.events.log(Event.ABANDONED_WITHOUT_FAILURE, step=step, why=str(e))
            logger.error("process %d left step %d's program, but no member failed; exiting to rejoin",
                         self.group.process_id, step)
            os._exit(EXIT_HUNG)
        except Reached:
            return None
        except Skip as e:
            self._took_spare = e.spare
            if not e.spare:
                self.events.log(Event.STEP_WAITING, step=step, members=list(self._too_few or ()),
                                min_members=self.options.retry.min_members)
            if e.verdict is not None and m is not None:  # every member left this step alive: all admit alike
                self.executor.admit(m, e.verdict, step, **({"before_step": True} if e.spare else {}))
            return None
        except BaseException:  # (last: after the step's own exceptions)
            self.executor.pipeline.leave(f"step {step} raised")
            raise
        self._resync = False
        if ran.defer:  # run, not yet committed: the next commit query commits it, or it is undone
            self.commits.defer(ran.record(self.group.generation), (self.step, self.state, self.executor.remembered))
            self._advance(ran)
            return None
        return self._commit(ran)

    def _failed(self, step: int, why: str, log: bool = True, **fields: Any) -> StepRecord | None:
        """Bookkeeping of an attempt that failed everywhere: None, the attempt's result (no commit)."""
        self._roll_back(f"step {step} did not commit")
        self.executor.ballot.batcher.failed()
        self._last_failure = why
        self.faults.at_width(None)
        if log:
            self.events.log(Event.STEP_FAILED, step=step, **fields)
        self.group.exit_if_finished_before_joining()
        return None

    def _attempt(self, step: int, m: Members) -> Ran:
        """Inside the group's step: run step ``step`` on the members ``m`` (rehydrating those behind
        first), read its votes, start the next step early where agreed, and say whether its
        commit is left to a later step."""
        changed, ex = m.reset or m.gained, self.executor
        early = ex.pipeline.take(step, m.mesh, lambda inputs: ex.last_output(self.state, m) is inputs, changed)
        if self.group.target is not None and self.step >= self.group.target:
            raise Reached  # (trained on, it would commit a step past the run's end)
        self.faults.at_width(len(m.process_ids))
        voting = ex.voting()
        if len(m.process_ids) < self.options.retry.min_members:  # every member sees the same m: all skip
            self._too_few = m.process_ids
            raise Skip(ex.votes_alone(m, self.step) if voting else None)  # (its joiners can still enter)
        if voting and (alone := ex.spare_first(m, self.step)) is not None:
            raise Skip(alone, spare=True)  # no step commits without the spare: it enters first
        state, rehydrated = self.state, None
        resync = changed or self._resync
        if m.gained or self._resync:
            if self.group.joining:
                self.faults.point("admitted", step)
            step, state, rehydrated = self.sync.sync(self.step, self.state, m)
            self._in_step = step
        t0 = time.monotonic()
        if early is not None:  # started during the last commit (pipeline)
            (new_global, host), local_error = early
        else:
            new_global, host, local_error = ex.run(step, state, m)
        seconds = time.monotonic() - t0
        ex.ballot.ran(state)
        metrics, verdict = read_outputs(host, voting, len(m.devices), local_error)
        self.faults.point("after-grad", step)
        # Read before the next program starts (pipeline): on CPU a read then waits behind it.
        ran = Ran(step, m, new_global, scalars(metrics), verdict, rehydrated, seconds)
        checking = bool(self.options.check_every) and (step + 1) % self.options.check_every == 0
        ahead = voting and verdict is not None and step_core.runs_ahead(verdict)
        if ahead and not checking:  # the next step's program, as soon as this one's ended
            ex.start_ahead(step + 1, m, new_global)
        ran.new_state = local_copy(new_global)
        if checking:
            bad = transfer.check_consistent(ran.new_state, m.mesh)
            if bad:
                raise ConsistencyError(step + 1, bad)
            if ahead:  # (after the check: its collective must not run beside the step's)
                ex.start_ahead(step + 1, m, new_global)
        ran.defer = voting and verdict is not None and step_core.defers(verdict, members_changed=resync)
        if ran.defer:
            self.group.defer_commit()
        ran.ended = time.monotonic()  # (the commit query's time, for commit_every="auto")
        return ran

    def _advance(self, ran: Ran) -> None:
        """This process now holds ``ran``'s step and state (committed, or pending a commit)."""
        self.step, self.state = ran.step + 1, ran.new_state
        self.executor.remember(ran.members, ran.new_state, ran.new_global)
        self.last_metrics = ran.metrics

    def _commit(self, ran: Ran) -> StepRecord:
        """Bookkeeping of a commit: the events, the admissions, the warm-up, ``on_commit``."""
        m = ran.members
        if ran.rehydrated is not None:
            self.sync.joined(ran.rehydrated)
        self.executor.ballot.batcher.committed(time.monotonic() - ran.ended)
        self._advance(ran)
        record = ran.record(self.group.generation)  # (the generation agreed with the donor's after a rejoin)
        committed = self.commits.commit(record)
        for r in committed:  # (with commit_every, the steps run since the last commit, then this one)
            self.events.log(Event.COMMIT, step=r.step, members=list(r.members), generation=r.generation, loss=r.loss)
        if m.reset:
            self.executor.log_rebuild(ran.step, ran.seconds)
        self.group.data_plane.after_commit()  # (a collection once after a rebuild, also one whose own step failed)
        if ran.verdict is not None:  # (held at a member's last step: nobody is admitted then)
            self.executor.admit(m, ran.verdict, ran.step + 1)
        self.sync.publish(m.process_ids, self.state)
        self.precompiler.after_commit(m.process_ids, self.state)
        if self.on_commit is not None:
            self.executor.pipeline.settle()  # (a hook may run programs of its own: none may run beside the step's)
            self.on_commit(self, record)
        for r in committed:
            self.faults.point("after-commit", r.step)
        return record

    def commit_alone_at(self, when: Callable[[int], bool]) -> None:
        """With ``commit_every="auto"``: commit alone each step after which ``when(loop.step)``
        holds (``on_commit`` then sees that step; a checkpointer's saves)."""
        self.executor.ballot.commit_at.append(when)

    def settle(self) -> None:
        """Wait for a step program started early (``pipeline``) to end, keeping its result for
        the next :meth:`try_step`: afterwards nothing of this loop runs on the devices."""
        self.executor.pipeline.settle()

    def log_final(self, params: PyTree | None = None) -> dict:
        """Log the ``final`` event with the sha256 of ``params`` (default: the state's ``params``
        field or key if it has one, else the whole state)."""
        return self.events.log(Event.FINAL, **final_fields(self, params))


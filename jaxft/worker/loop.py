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

Your step: ``step_fn(state, batch, mask) -> (new_state, metrics)``, where ``batch`` is the
global batch pytree ``[P, ...]`` sharded over the members (``P >= G``, padding masked out by
``mask [P]``) and ``metrics`` a dict of scalars (a ``"loss"`` entry is logged with each commit).
Normalise by the global batch size ``G`` (``loop.global_batch``), never by ``P`` or the number
of devices, so a step computes the same whoever is alive::

    def step_fn(state, batch, mask):
        def loss_fn(params):
            per_example = ...                              # [P]
            return jnp.sum(per_example * mask) / G
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    loop = jaxft.ElasticLoop(step_fn, state, data, runtime=rt)
    state = loop.run(num_steps)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxft.core import step as step_core
from jaxft.core import votes as votes_lib
from jaxft.errors import ConfigError, ConsistencyError, RetryBudgetExceeded, StateMismatch, StepFailed, TooFewMembers
from jaxft.events import EventLog
from jaxft.faults import FaultInjector
from jaxft.protocol import EXIT_HUNG, EXIT_STOPPED, Event
from jaxft.types import PyTree
from jaxft.worker import admission as admission_lib
from jaxft.worker import breaker, rejoin, stopping, transfer, warmup
from jaxft.worker import executables as executables_lib
from jaxft.worker import runner as runner_lib
from jaxft.worker.data import batch_specs, shard_batch, step_batch
from jaxft.worker.membership import ElasticGroup, Members

logger = logging.getLogger(__name__)

StepFn = Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, dict]]  # (state, batch, mask) -> (state, metrics)


def _with_votes(fn: Callable, mesh: Mesh) -> Callable:
    """``fn`` plus the votes (:mod:`jaxft.core.votes`): ``(state, batch, mask, votes[D, W]) -> (...,
    agreed[W])``, one jitted program, so agreeing costs no extra round trip.

    The votes are summed in float32, so that XLA merges their all-reduce with the
    step's own (gradients and loss: one all-reduce op per step, checked in the compiled
    program by ``tests/test_admission.py``); as a max over int32 they were a second one,
    independent of the step's and scheduled before it. Meant against gloo's "op.preamble.length
    <= op.nbytes. 32 vs 4" abort of a survivor when a member dies (all of XLA's CPU collectives
    share one gloo slot, so a member a collective ahead of its peer sends chunks of the wrong
    size), it does not close it: XLA runs a tuple all-reduce as one gloo all-reduce per element
    on that slot. ``ElasticTrainer``'s step therefore sums its gradients, loss and votes in one
    buffer itself (``step_takes_votes``); this wrapper remains for steps brought along."""
    def step(state, batch, mask, votes):
        new_state, metrics = fn(state, batch, mask)
        return new_state, metrics, _agree(votes)

    return jax.jit(step, out_shardings=NamedSharding(mesh, P()))


def _agree(votes: jax.Array) -> jax.Array:
    """``agreed [W]`` from the members' votes ``[D, W]``: summed over the devices in float32 (see
    :func:`_with_votes`), then :func:`agreed_votes`."""
    return agreed_votes(jnp.sum(votes.astype(jnp.float32), axis=0))


def agreed_votes(total: jax.Array) -> jax.Array:
    """``agreed [W] int32`` from the votes summed over the devices (``total [W]``, float32; see
    :mod:`jaxft.core.votes`): the admission columns as ``HOLD`` / ``READY`` / 0 (ready votes
    add up to at most the devices, a hold outweighs them all), the others as counts. A step
    that sums the votes itself returns this."""
    p = total.shape[-1] - votes_lib.EXTRA
    adm = total[..., :p]
    agreed = jnp.where(adm >= votes_lib.HOLD, votes_lib.HOLD, (adm > 0) * votes_lib.READY)
    return jnp.concatenate([agreed, total[..., p:]], axis=-1).astype(jnp.int32)


def _votes_spec(mesh: Mesh, axis_name: str) -> jax.ShapeDtypeStruct:
    """The shape of :func:`_votes_array`'s result, for compiling ahead of time."""
    return jax.ShapeDtypeStruct((mesh.devices.size, votes_lib.width(jax.process_count())), np.dtype(np.int32),
                                sharding=NamedSharding(mesh, P(axis_name)))


def _votes_array(votes: np.ndarray, mesh: Mesh, axis_name: str) -> jax.Array:
    """This process's vote row (:func:`jaxft.core.votes.row`) on each of its devices, as a global ``[D, W]`` array."""
    n = mesh.devices.size
    rows = np.broadcast_to(votes, (n, votes.size))
    return jax.make_array_from_callback((n, votes.size), NamedSharding(mesh, P(axis_name)), lambda i: rows[i])


def _shapes(tree: PyTree) -> PyTree:
    """``tree``'s leaves (numpy or jax arrays, see :func:`canonical`) as ShapeDtypeStructs."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=bool(getattr(x, "weak_type", False))), tree)


class _Skip(Exception):
    """Leave a step without committing (all members agree on why)."""


class _VotedFail(Exception):
    """Leave a step without committing: a member voted ``fail`` (it could not build its inputs)."""

    def __init__(self, error: Exception | None):
        super().__init__(str(error) if error is not None else "a member could not build its inputs")
        self.error = error  # this member's own error, None if another member's


class _Desync(Exception):
    """Leave a step without committing: the members ran different steps (their step votes differ)."""


class _Refused(Exception):
    """Leave a step without committing: joiners whose state does not match the members' (they exit)."""

    def __init__(self, processes: list[int]):
        super().__init__(f"processes {processes} hold a state that does not match the members'; they leave")
        self.processes = processes


class _Reached(Exception):
    """Leave a step without running it: entering it restored the run's last step (a restore
    put off to a cold start, :meth:`jaxft.ElasticGroup.on_cold_start`), so nothing is left to train."""


@dataclasses.dataclass
class _Ahead:
    """A step's program started before the step ahead of it committed (``pipeline``)."""

    step: int  # the step it runs
    worker: Any  # its call in the StepRunner
    mesh: Mesh
    inputs: PyTree  # the global state it started from: the previous step's output
    result: tuple | None = None  # ("done", outputs) or ("error", exception), once collected
    error: Exception | None = None  # why this member ran it on placeholders (its inputs failed)


@dataclasses.dataclass
class StepRecord:
    """What one commit produced (passed to ``on_commit``)."""

    step: int
    loss: float | None
    members: tuple[int, ...]
    generation: int
    incarnations: dict[int, int] = dataclasses.field(default_factory=dict)  # process -> service incarnation
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


def replicate(tree: PyTree, mesh: Mesh) -> PyTree:
    """A replicated global view of this process's copy (no data moves between processes)."""
    sharding = NamedSharding(mesh, P())
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]

    def one(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        return jax.make_array_from_single_device_arrays(np.shape(x), sharding,
                                                        [jax.device_put(x, d) for d in local])

    return jax.tree_util.tree_map(one, tree)


def local_copy(tree: PyTree) -> PyTree:
    """This process's copy of a replicated tree, as single-device arrays."""
    return jax.tree_util.tree_map(lambda x: x.addressable_data(0), tree)


def to_host(tree: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda x: np.array(x), tree)


def canonical(tree: PyTree) -> PyTree:
    """Host leaves (Python scalars, numpy arrays) as numpy arrays of the dtype JAX would give
    them (``0`` -> int32 without x64): the state has the same bytes on a process that has not
    stepped yet as on one holding a step's output, as the rejoin's transfer requires."""
    def one(x):
        if isinstance(x, jax.Array):
            return x
        a = np.asarray(x)
        return a.astype(jax.dtypes.canonicalize_dtype(a.dtype), copy=False)

    return jax.tree_util.tree_map(one, tree)


def host_copies(tree: PyTree, start: bool = True) -> PyTree:
    """This process's copy of each array leaf of a replicated ``tree``, with ``start`` its
    copy to host memory started (``copy_to_host_async``), so that reading it once the
    program is done waits for no transfer. Called right after the step's program is
    dispatched: on a GPU a scalar read after the program cost ~0.5 ms each (measured on an
    H200, jax 0.11.2); started early, the copies overlap the program. On CPU the arrays are
    in host memory already (starting copies there cost ~0.06 ms a step, for nothing)."""
    def one(x):
        if not isinstance(x, jax.Array):
            return x
        x = x.addressable_data(0) if not x.is_fully_addressable else x
        if start:
            x.copy_to_host_async()
        return x

    return jax.tree_util.tree_map(one, tree)


def _scalars(metrics: Any) -> dict[str, float]:
    """``metrics`` (as :func:`host_copies` returns them: this process's arrays) as floats."""
    if not isinstance(metrics, dict):
        metrics = {"loss": metrics} if metrics is not None else {}
    return {str(k): float(np.asarray(v)) for k, v in metrics.items()}


class ElasticLoop:
    """Runs your step function elastically (see the module docstring).

    Args:
      step_fn: ``(state, batch, mask) -> (new_state, metrics)``; jitted here once per member
        set with replicated outputs (an already-jitted function is fine).
      state: the initial state pytree (every process must pass the same values). Prefer host
        copies (``jax.tree_util.tree_map(np.array, state)``) and keep no jax array of it alive
        in your program: on CPU a rejoin rebuilds the backend, and arrays of the old one that
        stay referenced keep its memory (a ``backend_leaked`` event says so).
      data: maps a step to its global batch: ``.batch(step)`` and ``.global_batch``.
      runtime: what :func:`jaxft.initialize` returned (events and fault points).
      make_step: instead of ``step_fn``, ``mesh -> callable`` building the step for a mesh
        (for steps whose code depends on the mesh).
      step_takes_votes: with ready admission, ``make_step``'s steps take the admission votes
        and return the agreement themselves, ``(state, batch, mask, votes[D, P]) -> (state,
        metrics, agreed[P])`` (see :func:`agreed_votes`), so that they can sum the votes in
        their own collective (``ElasticTrainer`` does: one buffer, one all-reduce).
      micro_batch: with ``stacked``, examples per device per micro-batch.
      stacked: give the step ``batch [M, D*m, ...]`` and ``mask [M, D*m]`` (``M``
        micro-batches, for gradient accumulation inside the step) instead of ``[P, ...]``.
      chunk: with ``stacked``, micro-batches of exactly ``chunk`` examples whatever the
        number of devices (:meth:`jaxft.Layout.chunked`; overrides ``micro_batch``): what a
        step whose bits must not depend on the width needs (``ElasticTrainer``'s exact reduction).
      check_every: every N steps, verify that all members hold bitwise-identical state.
      on_commit: ``(loop, record)`` after every commit.
      min_members: commit no step with fewer live processes than this; wait for more (up to
        ``Timeouts.barrier``), then raise :class:`~jaxft.errors.TooFewMembers`.
      max_attempts: failed attempts in a row at one step before
        :class:`~jaxft.errors.RetryBudgetExceeded` (None: unbounded).
      precompile: after the members change, process 0 compiles the step in the background
        for each member set one failure away (the members less one process), while there are
        at most this many members (0: never), so that survivors of a failure load the
        executable from the persistent compilation cache instead of compiling it
        (:mod:`jaxft.worker.warmup`).
      pipeline: start step ``k+1``'s program as soon as step ``k``'s has ended, before step
        ``k``'s commit query, so that the query (one coordination-service round trip) and
        the commit's bookkeeping run while the devices compute. Nothing changes in what
        commits: if step ``k`` does not commit, the early program is left (and on CPU the
        data plane broken, so it ends at once) and step ``k`` is retried as without it.
        Only in steady state (the run's end known: :meth:`run`; nobody joining; no stop
        requested; no fault rule of this process at step ``k+1``); ``on_commit`` runs once
        the early program ended (so a hook may run programs of its own), and a caller of
        :meth:`try_step` that runs other programs on the run's devices between steps calls
        :meth:`settle` first.
      commit_every: with N > 1, a commit covers up to N steps: the commit query (one
        coordination-service round trip) is made at every step ``k`` with ``(k + 1) % N == 0``
        and skipped at the others, whose commit the next query makes with its own, all or
        none: if a step fails, the steps run since the last commit are undone on every
        member (``rolled_back`` event) and run again, so a failure costs up to N steps more.
        What it buys: the round trip's CPU once per N steps (on a CPU-bound machine, where
        every member's and the coordinator's share of it comes out of the step). A step
        commits alone anyway when joiners are admitted, the members changed (its first
        step), the run ends, or a member was asked to stop. ``on_commit`` runs once per
        commit, for its last step (``loop.step`` then a multiple of N, or a step that
        committed alone): a hook that acts every K steps needs K a multiple of N (the
        :class:`~jaxft.ElasticCheckpointer` checks). Between commits, :attr:`step` and
        :attr:`state` are those of the last step run; :attr:`pending` says how many of them
        are not committed yet. Needs the run's end known, as ``pipeline`` does.
    """

    def __init__(self, step_fn: StepFn | None, state: PyTree, data, *, runtime=None,
                 events: EventLog | None = None, faults: FaultInjector | None = None,
                 make_step: Callable[[Mesh], Callable] | None = None, micro_batch: int | None = None,
                 stacked: bool = False, check_every: int = 0, group: ElasticGroup | None = None,
                 on_commit: Callable[[Any, StepRecord], None] | None = None, step: int = 0,
                 min_members: int = 1, max_attempts: int | None = 100, chunk: int | None = None,
                 precompile: int = 0, step_takes_votes: bool = False, pipeline: bool = False,
                 commit_every: int = 1):
        if (step_fn is None) == (make_step is None):
            raise ValueError("pass exactly one of step_fn and make_step")
        if min_members < 1:
            raise ValueError(f"min_members must be >= 1, got {min_members}")
        if max_attempts is not None and max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 or None, got {max_attempts}")
        if commit_every < 1:
            raise ValueError(f"commit_every must be >= 1, got {commit_every}")
        self.min_members = min_members
        self.max_attempts = max_attempts
        self._too_few: tuple[int, ...] | None = None
        self._last_failure = ""
        self.step_fn = step_fn
        self.make_step = make_step
        self.step_takes_votes = step_takes_votes and make_step is not None
        self.data = data
        self.micro_batch = micro_batch
        self.stacked = stacked
        self.chunk = chunk if stacked else None
        self.check_every = check_every
        self.events = events or (runtime.events if runtime is not None else EventLog(None, jax.process_index()))
        self.faults = faults or (runtime.faults if runtime is not None else FaultInjector([], jax.process_index()))
        self.group = group or ElasticGroup()
        if self.group.admission is None:  # this loop carries the admission votes (see ElasticGroup)
            self.group.admission = "ready"
        self.on_commit = on_commit
        self.step = step  # steps committed
        self.state = canonical(state)
        self.last_metrics: dict[str, float] = {}
        self._compiled: dict[tuple, Callable] = {}  # by mesh ids (("votes", *ids): _agree_on_joiners)
        # The last step's replicated outputs, reused while the members and the state stay the same.
        self._global: tuple | None = None  # (device ids, ids of the local leaves, global state)
        self.executables = executables_lib.Executables(executables_lib.shared_dir(), reference=self._reference_program)
        self._runner = runner_lib.StepRunner()
        self._holding = False  # this member holds admissions back (see _hold_if_left)
        self.group.on_reset(before=self._drain_programs)  # first: nothing may run under the rebuild
        self.group.on_reset(before=self._state_to_host, after=self._after_reset)
        self.group.on_reset(before=lambda: self.faults.point("during-rebuild", self._in_step))
        self.group.before_admission(self._prepare_admission)
        self.precompile = precompile
        self._warmer: warmup.Warmer | None = None
        self._warmed_for: tuple[int, ...] | None = None  # the member set the last warm-up was for
        self._precompiled: set[tuple[int, ...]] = set()  # member sets compiled ahead in this life
        self._leaks_logged = 0
        self._batch_template: PyTree | None = None  # shapes and dtypes of a host global batch
        self._votes: tuple | None = None  # ((device ids, vote bytes), global votes array): see _votes_on
        self._mask: tuple | None = None  # (mesh, global batch, the placed batch mask): see _batch
        self.pipeline = pipeline
        self._ahead: _Ahead | None = None  # the next step's program, started early (pipeline)
        self.started_early = 0  # committed steps whose program started before the last commit
        self.left_early = 0  # programs started early and left: the step before them failed
        self.commit_every = commit_every
        self._pending: list[StepRecord] = []  # steps run since the last commit (commit_every)
        self._before_pending: tuple | None = None  # (step, state, _global) as the last commit left them
        self.rolled_back = 0  # steps run, then undone because a later step of their commit failed
        self._resync = False  # the members ran different steps: the next step brings them together
        self._checked: set[int] = set()  # ids of the step functions whose outputs were checked
        self._signature: rejoin.Signature | None = None  # the state's structure (see _sync_state)
        self._signature_published = False
        self.group.before_admission(self._check_signature, may_raise=True)
        self._in_step = step  # the step the attempt in progress runs (for the in-commit fault point)
        self.group.before_exit_query = lambda: self.faults.point_soon("in-commit", self._in_step)

    @property
    def global_batch(self) -> int:
        return int(self.data.global_batch)

    @property
    def last_loss(self) -> float | None:
        return self.last_metrics.get("loss")

    @property
    def pending(self) -> int:
        """Steps run since the last commit, committed by the next one or undone (``commit_every``)."""
        return len(self._pending)

    # -- state --------------------------------------------------------------------------
    def _abandon(self, info: dict) -> bool:
        """From the hang monitor: leave the doomed step's program (see jaxft.worker.runner)."""
        if not self._runner.abandon(info["phase"]):
            return False
        self.events.log(Event.ABANDONED, step=self.step, **info)
        return True

    def _drain_programs(self) -> None:
        """Before a backend rebuild: wait for step programs this process left (an abandoned
        one ends when gloo's collective timeout fires); exit to rejoin past that bound."""
        self._settle(drop=True)  # (a step started ahead: only defensively, the members did not change)
        bound = self.group.timeouts.collective + 2.0
        if not self._runner.drain(bound):
            logger.error("process %d: a step program it left is still running after %.0f s; exiting to rejoin",
                         self.group.process_id, bound)
            os._exit(EXIT_HUNG)

    def _hold_if_left(self, votes: np.ndarray, m: Members) -> np.ndarray:
        """This member's admission votes, held (:func:`jaxft.worker.admission.held`) while a step
        program it left still runs: an admission's rebuild would wait for that program (up to
        the collective timeout) with every member; held, they go on at their width."""
        if not self._runner.pending():
            self._holding = False
            return votes
        ready = [p for p, v in enumerate(votes) if v == admission_lib.READY]
        if ready and not self._holding:
            self._holding = True
            self.events.log(Event.ADMISSION_HELD, step=self.step, joiners=ready)
        return admission_lib.held(votes, m.process_ids)

    def _state_to_host(self) -> None:
        self._roll_back("the backend is rebuilt")  # (never with steps pending: they commit or fail first)
        self._global = None
        self._votes = self._mask = None  # (arrays of the backend a rebuild replaces)
        self.state = to_host(self.state)

    def restore(self, step: int, state: PyTree) -> None:
        """Continue from ``(step, state)`` (e.g. a checkpoint) instead of the initial state."""
        self._pending, self._before_pending = [], None
        self.step, self.state, self._global = int(step), canonical(state), None

    def _after_reset(self) -> None:
        self._compiled.clear()
        self.executables.reset()

    def _fn(self, m: Members) -> Callable:
        return self._fn_for(m.mesh)

    def _call(self, mesh: Mesh, fn: Callable, args: tuple) -> Any:
        """``fn(*args)`` through :mod:`jaxft.worker.executables` (no tracing after a rebuild, programs
        compiled by process 0 loaded instead of traced); plain call for a step without ``lower``."""
        if not hasattr(fn, "lower"):
            return fn(*args)
        compiler = self.group.process_id == min(d.process_index for d in mesh.devices.flat)  # the others wait
        return self.executables.call(executables_lib.mesh_ids(mesh), fn, args, compiler)

    def _fn_for(self, mesh: Mesh) -> Callable:
        """The jitted step for ``mesh`` (one per device set; the background warm-up uses it too)."""
        key = executables_lib.mesh_ids(mesh)
        fn = self._compiled.get(key)
        if fn is None:
            if self.make_step is not None:
                fn = self.make_step(mesh)
            else:
                fn = jax.jit(self.step_fn, out_shardings=NamedSharding(mesh, P()))
            if self.group.admission == "ready" and not self.step_takes_votes:
                fn = _with_votes(fn, mesh)
            elif self.precompile and not hasattr(fn, "lower"):  # a plain function around jitted ones
                fn = jax.jit(fn, out_shardings=NamedSharding(mesh, P()))  # one program, to compile ahead
            fn = self._compiled.setdefault(key, fn)
        return fn

    # -- compiling ahead (jaxft.worker.warmup) ---------------------------------------------------
    def _warm_up(self, m: Members) -> None:
        """Process 0, after a commit on a member set it did not warm up for yet: compile, in
        the background, the step for each set one failure away (same state and batch shapes,
        another mesh) into jax's caches, the persistent one included (see :mod:`jaxft.worker.warmup`)."""
        if (not self.precompile or len(m.process_ids) > self.precompile or self._batch_template is None
                or self.group.process_id != 0 or self._warmed_for == m.process_ids):
            return
        if self._warmer is None:
            self._warmer = warmup.Warmer(on_done=self._precompiled_one)
            self.group.on_reset(before=self._warm_pause, after=self._warmer.resume)
        self._warmed_for = m.process_ids
        state = _shapes(self.state)
        template = self._batch_template
        for pids in warmup.shrinks(m.process_ids, self.min_members):
            if pids in self._precompiled:  # on disk already: after a rebuild it loads from there
                continue
            self._warmer.submit(pids, lambda pids=pids: self._compile_for(self._mesh_of(pids), state, template))
        everyone = tuple(range(jax.process_count()))
        if m.process_ids != everyone and ("rehydrate", everyone) not in self._precompiled:
            # someone is missing: the rejoin's transfer, from the donor it will have (the lowest member)
            nbytes = transfer.tree_nbytes({"step": np.int64(0), "state": self.state})
            self._warmer.submit(("rehydrate", everyone), lambda: transfer.compile_broadcast(
                nbytes, min(m.process_ids), self._mesh_of(everyone), self.group.axis_name))

    def _prepare_admission(self, pids: tuple[int, ...]) -> None:
        """A joiner, before it says it is ready: the step for the members it will enter, so that
        the admission step loads it (:mod:`jaxft.worker.executables`) instead of tracing it."""
        t0 = time.monotonic()
        mesh = self._mesh_of(pids)
        if self._batch_template is None:
            host = step_batch(self.data, self.step, mesh, self.micro_batch if self.stacked else None, self.chunk)
            self._batch_template = _shapes(host)
        self._compile_for(mesh, _shapes(self.state), self._batch_template)
        logger.info("process %d compiled the step for %s before admission in %.2f s", self.group.process_id,
                    list(pids), time.monotonic() - t0)

    def _precompiled_one(self, key: tuple, seconds: float) -> None:
        """The warm-up thread compiled the step for the member set ``key`` (or, for
        ``("rehydrate", members)``, a rejoin's transfer); logged as ``precompiled``."""
        self._precompiled.add(key)
        if key and key[0] == "rehydrate":
            self.events.log(Event.PRECOMPILED, program="rehydrate", members=list(key[1]), seconds=round(seconds, 3))
        else:
            self.events.log(Event.PRECOMPILED, program="step", members=list(key), seconds=round(seconds, 3))

    def _log_leaks(self) -> None:
        """A ``backend_leaked`` event for each rebuild after which arrays of the old CPU
        backend stayed alive (see :meth:`ElasticGroup._report_old_backends`)."""
        while self._leaks_logged < self.group.leaked_backends:
            self._leaks_logged += 1
            self.events.log(Event.BACKEND_LEAKED, step=self.step)

    def _mesh_of(self, pids: tuple[int, ...]) -> Mesh:
        """The 1-D mesh a step over processes ``pids`` runs on (devices sorted by id, as in
        :class:`~jaxft.Members`)."""
        devices = sorted((d for d in jax.devices() if d.process_index in pids), key=lambda d: d.id)
        return Mesh(devices, (self.group.axis_name,))

    def _compile_for(self, mesh: Mesh, state_shapes: PyTree, template: PyTree) -> None:
        """Lower and compile the step for ``mesh`` with the arguments :meth:`try_step` will give it."""
        fn, args = self._specs_for(mesh, state_shapes, template)
        if hasattr(fn, "lower"):
            self.executables.get(executables_lib.key(executables_lib.mesh_ids(mesh), args), fn, args)

    def _reference_program(self) -> str:
        """The step lowered for every process's devices: the same text in every process of a
        run with the same code and arguments, whatever mesh it first runs on (it names the
        programs the processes share, see :mod:`jaxft.worker.executables`)."""
        if self._batch_template is None:
            raise RuntimeError("no batch yet")
        fn, args = self._specs_for(self._mesh_of(tuple(range(jax.process_count()))), _shapes(self.state),
                                   self._batch_template)
        return fn.lower(*args).as_text()

    def _specs_for(self, mesh: Mesh, state_shapes: PyTree, template: PyTree) -> tuple[Callable, tuple]:
        """The step for ``mesh`` and the abstract arguments :meth:`try_step` will give it."""
        fn = self._fn_for(mesh)
        replicated = NamedSharding(mesh, P())
        state = jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated, weak_type=s.weak_type), state_shapes)
        micro = self.micro_batch if self.stacked else None
        batch, mask = batch_specs(template, mesh, self.group.axis_name, micro, flat=not self.stacked,
                                  chunk=self.chunk)
        args = (state, batch, mask) + ((_votes_spec(mesh, self.group.axis_name),)
                                       if self.group.admission == "ready" else ())
        return fn, args

    def _warm_pause(self) -> None:
        """Before a backend rebuild: no compile runs across it, and the next commit warms up anew."""
        self._warmer.pause()
        self._warmed_for = None

    def _votes_input(self, m: Members, step: int, fail: bool = False) -> jax.Array:
        """This member's vote row for the program of step ``step`` (:mod:`jaxft.core.votes`) as the
        ``[D, W]`` input of the program that sums it: the joiners it saw ready (held while a
        program it left still runs, and at its run's last step), whether it could build its
        inputs (``fail``), and its own conditions for what follows the step: whether step
        ``step + 1`` may start early (``pipeline``) and whether this step may leave its commit
        to a later one (``commit_every``). Its run's end is its own too: a member whose run
        ends here (a restart catching up in an earlier ``run()``) makes every member commit,
        admit nobody and start nothing early, as they all would at their own last step."""
        admission = self._hold_if_left(self.group.votes(m), m)
        own = step_core.own_votes(step, self.group.target, pipeline=self.pipeline,
                                  next_quiet=self.faults.quiet_at(step + 1), commit_every=self.commit_every,
                                  stop_requested=stopping.requested())
        if own.hold:  # no admission after the run's last step
            admission = admission_lib.held(admission, m.process_ids)
        row = votes_lib.row(admission, step, fail=fail, not_ahead=own.not_ahead, commit=own.commit)
        return self._votes_on(row, m)

    def _defers(self, m: Members, verdict: votes_lib.Verdict | None, resync: bool) -> bool:
        """Whether the step leaves its commit to the next step's query (``commit_every``): only on
        what the members share (:func:`jaxft.core.step.defers`)."""
        return (verdict is not None and self.group.admission == "ready"
                and step_core.defers(verdict, members_changed=m.reset or m.gained or resync))

    def _roll_back(self, why: str) -> None:
        """Undo the steps run since the last commit: a later step of that commit failed."""
        if not self._pending:
            return
        undone = [r.step for r in self._pending]
        self.step, self.state, self._global = self._before_pending
        self._pending, self._before_pending = [], None
        self.rolled_back += len(undone)
        self.events.log(Event.ROLLED_BACK, step=self.step, steps=undone, why=why)

    def _admit(self, m: Members, verdict: votes_lib.Verdict, step: int) -> None:
        """Admit the joiners the members agreed on; they enter at ``step`` (``admit`` event)."""
        admitted = self.group.admit(m, verdict.admission)
        if admitted:
            self.events.log(Event.ADMIT, step=step, joiners=list(admitted))
            self.faults.point("admitting", step)

    def _votes_on(self, votes: np.ndarray, m: Members) -> jax.Array:
        """``votes`` as the step's ``[D, P]`` input, the last step's array while the votes and
        the devices stay the same (nearly every step: nobody waits to join), not a new one
        per step (``make_array_from_callback``: ~0.14 ms of each step's host time)."""
        key = (tuple(d.id for d in m.devices), votes.tobytes())
        if self._votes is None or self._votes[0] != key:
            self._votes = (key, _votes_array(votes, m.mesh, self.group.axis_name))
        return self._votes[1]

    def _agree_on_joiners(self, m: Members) -> votes_lib.Verdict:
        """With too few members to commit (``min_members``), the votes alone, summed over the
        members by a program of their own: the joiners they wait for are admitted as at a
        commit (with no step to carry the votes, they would wait for each other until a
        timeout ended the run)."""
        key = ("votes",) + executables_lib.mesh_ids(m.mesh)
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled.setdefault(key, jax.jit(_agree, out_shardings=NamedSharding(m.mesh, P())))
        votes = self._votes_input(m, self.step)
        out = self._runner.run(lambda: jax.block_until_ready(fn(votes)))
        return votes_lib.read(np.asarray(out.addressable_data(0)), len(m.devices))

    def _replicated(self, state: PyTree, m: Members) -> PyTree:
        g = self._last_output(state, m)
        return g if g is not None else replicate(state, m.mesh)

    def _last_output(self, state: PyTree, m: Members) -> PyTree | None:
        """The last step's replicated output if ``state`` is still its local copy on ``m``'s devices."""
        g = self._global
        leaves = jax.tree_util.tree_leaves(state)
        if (g is not None and g[0] == tuple(d.id for d in m.devices) and len(g[1]) == len(leaves)
                and all(a is b for a, b in zip(g[1], leaves))):
            return g[2]
        return None

    # -- the next step's program, started early (pipeline) --------------------------------
    def _job(self, step: int, fn: Callable, args: tuple, mesh: Mesh, fault_point: bool = True) -> Callable:
        """What the step runner runs for one step: the program, then its outputs made ready."""
        on_cpu = self.group.platform == "cpu"

        def program():
            if fault_point:
                self.faults.point("in-step", step)
            if self._runner.left():  # (left during the fault point's hang, or before it began)
                return None
            outputs = self._call(mesh, fn, args)
            host = host_copies(outputs[1:], start=not on_cpu)  # metrics (and votes): to host memory
            return jax.block_until_ready(outputs[0]), jax.block_until_ready(host)

        return program

    def _may_run_ahead(self, verdict: votes_lib.Verdict | None) -> bool:
        """Whether the next step may start before this one commits (see ``pipeline``).

        Every member must decide the same: one that does not start it early runs ``on_commit``
        first, whose collectives (an Orbax save's) would then wait for the others' early
        program, and it for them, until gloo's timeout (seen in the main job when only one
        member had a fault rule at the next step). So the decision rests only on the step's
        agreed votes, which say that nobody joins (the members stay the same unless one
        fails) and carry each member's own conditions (:meth:`_votes_input`).
        """
        return verdict is not None and self.group.admission == "ready" and step_core.runs_ahead(verdict)

    def _start_ahead(self, step: int, m: Members, inputs: PyTree) -> None:
        """Start step ``step``'s program on this step's output (see ``pipeline``). If this
        member cannot build its inputs (its data source failed), the program still starts,
        on placeholders and with a ``fail`` vote, since the others started theirs: the step
        then fails everywhere (see :meth:`_inputs`)."""
        fn = self._fn(m)
        (batch, mask), error = self._inputs(step, m)
        args = (inputs, batch, mask, self._votes_input(m, step, fail=error is not None))
        worker = self._runner.start(self._job(step, fn, args, m.mesh, fault_point=False))
        self._ahead = _Ahead(step, worker, m.mesh, inputs, error=error)

    def _collect(self, ahead: _Ahead) -> None:
        """Wait for ``ahead``'s program to end; keep what it gave (or raised)."""
        if ahead.result is None:
            try:
                ahead.result = ("done", self._runner.wait(ahead.worker))
            except Exception as e:  # noqa: BLE001 - handed to the step that takes it over
                ahead.result = ("error", e)

    def _take_ahead(self, step: int, m: Members) -> tuple | None:
        """``(outputs, error)`` of step ``step``'s program if it was started early on this very
        state and members (``error``: why it ran on placeholders, see :meth:`_start_ahead`);
        otherwise the early program (if any) is waited for and dropped."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        self._collect(ahead)
        usable = (ahead.step == step and ahead.mesh is m.mesh and not (m.reset or m.gained)
                  and self._last_output(self.state, m) is ahead.inputs)
        if not usable:
            logger.debug("process %d: dropped step %d's early program", self.group.process_id, ahead.step)
            return None
        kind, value = ahead.result
        if kind == "error":
            raise value
        return value, ahead.error

    def settle(self) -> None:
        """Wait for a step program started early (``pipeline``) to end, keeping its result for
        the next :meth:`try_step`: afterwards nothing of this loop runs on the devices."""
        if self._ahead is not None:
            self._collect(self._ahead)

    def _settle(self, drop: bool) -> None:
        """:meth:`settle`; with ``drop``, also forget the early program's result."""
        self.settle()
        if drop:
            self._ahead = None

    def _leave_ahead(self, why: str) -> None:
        """The step before the one started early did not commit: leave that program. On CPU
        its collective may wait on a member that died, so this process's data plane (which
        the retry rebuilds anyway) is broken to end it now rather than at gloo's timeout."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.result is not None:
            return
        self.left_early += 1
        if self._runner.abandon(why):
            if self.group.needs_data_plane_reset and jax.process_count() > 1:
                breaker.break_data_plane()
        else:  # it had ended: collect it (the runner hands each call's result once)
            self._collect(ahead)

    def _state_signature(self) -> rejoin.Signature:
        """The structure of :attr:`state` (treedef, shapes, dtypes), computed once (a restore or
        a rehydration brings values, never a new structure: both check it)."""
        if self._signature is None:
            self._signature = rejoin.Signature.of(self.state)
        return self._signature

    def _sync_state(self, m: Members) -> tuple[int, PyTree, rejoin.Rehydration | None]:
        """Agree on the step and the state's structure; rehydrate members behind the latest
        step from a donor (see :mod:`jaxft.worker.rejoin`). A member whose structure differs from the
        reference (a restart with another model) is refused before anything moves: it raises
        :class:`~jaxft.errors.StateMismatch` (a configuration error: it exits 78 and is not
        restarted), and the others leave the step untouched (:class:`_Refused`) and go on."""
        agreed = rejoin.agree(self.step, self.group.generation, self._state_signature(), m)
        self.group.generation = agreed.generation
        if agreed.refused:
            self.events.log(Event.STATE_MISMATCH, step=self.step, refused=list(agreed.refused), donor=agreed.donor)
            if self.group.process_id in agreed.refused:
                raise StateMismatch(f"process {self.group.process_id}'s state does not match the running members' "
                                    f"(process {agreed.donor}'s): its structure differs (treedef, shapes or dtypes); "
                                    "start every process with the same model and optimizer")
            raise _Refused(list(agreed.refused))
        return rejoin.rehydrate(self.step, self.state, m, self.group.process_id, agreed.steps,
                                on_start=lambda: self.faults.point("during-rehydrate", self.step))

    def _publish_signature(self, m: Members) -> None:
        """Once per life, the lowest member publishes the state's structure, which a restart
        compares with its own before it asks to be admitted (:meth:`_check_signature`)."""
        if self._signature_published or self.group.admission != "ready" or jax.process_count() == 1:
            return
        self._signature_published = True
        if self.group.process_id == min(m.process_ids):
            rejoin.publish_signature(self._state_signature())

    def _check_signature(self, pids: tuple[int, ...]) -> None:
        """A restart, before it tells the members it is ready: a state structure other than the
        one they published is refused here, before anything moves (one line, exit 78)."""
        published = rejoin.published_signature()
        mine = self._state_signature()
        if published is not None and published.digest != mine.digest:
            raise StateMismatch(f"process {self.group.process_id}'s state does not match the running members': "
                                f"{mine.difference(published)}; start every process with the same model and "
                                "optimizer")

    def _check_program(self, fn: Callable, state_in: PyTree, new_global: PyTree) -> None:
        """Once per step function: it must leave its input state alone (a donated input is
        gone, and a retry or a roll-back needs it) and return a replicated state (every member
        commits its own copy of it). Both are configuration errors, said in one line."""
        if id(fn) in self._checked:
            return
        self._checked.add(id(fn))
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree_util.tree_leaves(state_in)):
            raise ConfigError("the step function donated its input state (donate_argnums/donate_argnames): jaxft "
                              "keeps the state for a retry or a roll-back; jit the step without donating it")
        bad = [jax.tree_util.keystr(k) for k, x in jax.tree_util.tree_flatten_with_path(new_global)[0]
               if isinstance(x, jax.Array) and not x.sharding.is_fully_replicated]
        if bad:
            raise ConfigError(f"the step function returned a state that is not replicated over the members "
                              f"({', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}): return it with "
                              "out_shardings=NamedSharding(mesh, PartitionSpec())")

    def _inputs(self, step: int, m: Members) -> tuple[tuple[PyTree, jax.Array], Exception | None]:
        """Step ``step``'s placed batch and mask, and None; or, if this member cannot build them
        (its data source raised), placeholders of the same shapes and the error.

        A member that left the step on its own error would leave the others waiting in the
        step's collective (until gloo's timeout on CPU, for ever on GPU). With the
        placeholders it runs the program with a ``fail`` vote instead: the collective ends
        as usual and every member reads the same verdict, a failed step (see :meth:`try_step`).
        Without a batch seen yet (its shapes unknown) or outside ready admission (no votes),
        the error is raised as before."""
        try:
            return self._batch(step, m), None
        except Exception as e:
            if self._batch_template is None or self.group.admission != "ready":
                raise
            logger.error("process %d could not build step %d's batch (%s: %s); the step fails everywhere",
                         self.group.process_id, step, type(e).__name__, e)
            host = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), self._batch_template)
            micro = self.micro_batch if self.stacked else None
            return shard_batch(host, m.mesh, self.group.axis_name, micro, flat=not self.stacked,
                               chunk=self.chunk), e

    def _batch(self, step: int, m: Members) -> tuple[PyTree, jax.Array]:
        micro = self.micro_batch if self.stacked else None
        host = step_batch(self.data, step, m.mesh, micro, self.chunk)
        if self._batch_template is None:
            self._batch_template = _shapes(host)
        # The mask is the same every step on one mesh (placing it cost ~0.1 ms a step). Keyed by
        # the mesh object, not device ids: a backend rebuild brings new devices with the same ids.
        reuse = self._mask is not None and self._mask[0] is m.mesh and self._mask[1] == self.global_batch
        placed, mask = shard_batch(host, m.mesh, self.group.axis_name, micro, flat=not self.stacked, chunk=self.chunk,
                                   mask=self._mask[2] if reuse else None)
        self._mask = (m.mesh, self.global_batch, mask)
        return placed, mask

    # -- the loop -----------------------------------------------------------------------
    def run(self, num_steps: int, before_attempt: Callable[[], None] | None = None) -> PyTree:
        """Run until ``num_steps`` steps are committed; returns the final state.

        ``run()`` after ``run()`` continues: ``run(20); run(80)`` trains steps 0-19, then 20-79,
        in every process. A process restarted while its peers are in a later ``run()`` than
        the one it calls catches up: it is admitted and rehydrated at the members' step, and
        each earlier ``run()`` returns at once with that state, so the program reaches the
        members' ``run()`` and trains on with them. A process that starts (or restarts) after
        its peers finished the job's last run exits 0 (``SystemExit``) instead of running it
        again on its own. With fewer live members than ``min_members`` no step commits (the
        members wait, bounded); ``max_attempts`` failed attempts in a row at one step raise
        (with ``commit_every``, a step run and undone by a later step's failure does not
        count as progress).
        """
        run = self.group.begin_run(num_steps)
        if run.finished:  # restarted after the others finished: never train on alone
            self.events.log(Event.RUN_ALREADY_FINISHED, step=self.step, target=num_steps, run=run.index)
            logger.info("process %d: the others already finished this run; exiting 0", self.group.process_id)
            raise SystemExit(0)
        self.group.hang.finished(False)
        self.group.hang.on_hung = lambda info: self.events.log(Event.HUNG, step=self.step, **info)
        self.group.hang.abandon = self._abandon
        self.events.log(Event.TRAIN_START, step=self.step, total_steps=num_steps, run=run.index,
                        **({"catching_up": True} if run.passed else {}))
        failures, waiting_since, committed_at = 0, None, self.step
        while self.step < num_steps:
            if before_attempt is not None:
                before_attempt()
            record = self.try_step()
            if record is not None:
                failures, waiting_since, committed_at = 0, None, self.step
                stop_at = stopping.stop_step(self.step)
                if stop_at is not None and self.step >= stop_at:  # on_commit saved it if asked to
                    self._settle(drop=True)  # (every member stops here: all end the early program)
                    self.events.log(Event.STOPPED, step=self.step)
                    raise SystemExit(EXIT_STOPPED)
            elif self.pending:  # run, its commit left to a later step's (commit_every)
                waiting_since = None
            elif self._too_few is not None:  # nothing failed: too few members to commit
                waiting_since = waiting_since or time.monotonic()
                if time.monotonic() - waiting_since > self.group.timeouts.barrier:
                    raise TooFewMembers(f"only processes {list(self._too_few)} are alive, fewer than min_members="
                                        f"{self.min_members}, for {self.group.timeouts.describe('barrier')}")
                time.sleep(self.group.poll_s)
            else:
                if self.step != committed_at:  # (a rehydration or a restore moved it: a new step)
                    failures, committed_at = 0, self.step
                failures += 1
                if self.max_attempts is not None and failures >= self.max_attempts:
                    raise RetryBudgetExceeded(f"step {self.step} failed {failures} times in a row "
                                              f"(max_attempts={self.max_attempts}); last: {self._last_failure}")
        self._settle(drop=True)  # (none is started for the last step)
        self.group.finish(self.step)
        self._log_leaks()
        self.log_final()
        return self.state

    def try_step(self) -> StepRecord | None:
        """One attempt at the next step: the record of the commit it made, or None if it made
        none (it failed; or, with ``commit_every``, it ran and its commit is left to a later step)."""
        step = self._in_step = self.step
        self._too_few = None
        verdict: votes_lib.Verdict | None = None
        local_error: Exception | None = None
        self.faults.point("before-step", step)
        try:
            with self.group.step() as m:
                early = self._take_ahead(step, m)  # (before anything that may run a program)
                if self.group.target is not None and self.step >= self.group.target:
                    raise _Reached  # (trained on, it would commit a step past the run's end)
                self.faults.at_width(len(m.process_ids))
                if len(m.process_ids) < self.min_members:  # every member sees the same m: all skip
                    self._too_few = m.process_ids
                    if self.group.admission == "ready":  # the joiners they wait for can still enter
                        verdict = self._agree_on_joiners(m)
                    raise _Skip
                state, rehydrated = self.state, None
                resync = m.gained or self._resync
                if resync:
                    if self.group.joining:
                        self.faults.point("admitted", step)
                    step, state, rehydrated = self._sync_state(m)
                    self._in_step = step
                t_program = time.monotonic()
                if early is not None:  # started during the last commit (pipeline)
                    (new_global, host), local_error = early
                    self.started_early += 1
                else:
                    fn = self._fn(m)
                    (batch, mask), local_error = self._inputs(step, m)
                    args = (self._replicated(state, m), batch, mask)
                    if self.group.admission == "ready":  # the votes ride in the step's own program
                        args += (self._votes_input(m, step, fail=local_error is not None),)
                    # in a thread it can be left in (jaxft.worker.runner)
                    new_global, host = self._runner.run(self._job(step, fn, args, m.mesh))
                    self._check_program(fn, args[0], new_global)
                t_program = time.monotonic() - t_program
                if self.group.admission == "ready":
                    metrics, agreed = host
                    verdict = votes_lib.read(np.asarray(agreed), len(m.devices))
                    failure = step_core.verdict_failure(verdict)
                    if failure == "fail":
                        raise _VotedFail(local_error)
                    if failure == "desync":
                        raise _Desync
                else:
                    (metrics,) = host
                self.faults.point("after-grad", step)
                # Read before the next program starts (pipeline): on CPU a read then waits behind
                # the running program (the program being the longer path).
                scalars = _scalars(metrics)
                checking = bool(self.check_every) and (step + 1) % self.check_every == 0
                ahead = self._may_run_ahead(verdict)
                if ahead and not checking:  # the next step's program, as soon as this one's ended
                    self._start_ahead(step + 1, m, new_global)
                new_state = local_copy(new_global)
                if checking:
                    bad = transfer.check_consistent(new_state, m.mesh)
                    if bad:
                        raise ConsistencyError(step + 1, bad)
                    if ahead:  # (after the check: its collective must not run beside the step's)
                        self._start_ahead(step + 1, m, new_global)
                defer = self._defers(m, verdict, resync)
                if defer:
                    self.group.defer_commit()
        except StepFailed as e:
            self._leave_ahead(f"step {step} did not commit")
            self._roll_back(f"step {step} did not commit")
            self._last_failure = str(e)
            self.faults.at_width(None)
            self.events.log(Event.STEP_FAILED, step=step, failed=list(e.failed),
                            cause=str(e.cause).splitlines()[0][:300] if e.cause else "membership changed")
            self.group.exit_if_finished_before_joining()
            return None
        except _VotedFail as e:  # a member could not build its inputs: every member fails the step
            self._roll_back(f"step {step} did not commit")
            self.faults.at_width(None)
            own = e.error is not None
            why = f"{type(e.error).__name__}: {e.error}" if own else "another member could not build its inputs"
            self._last_failure = why
            self.events.log(Event.STEP_FAILED, step=step, failed=[], cause=why.splitlines()[0][:300], own=own)
            return None
        except _Desync:  # the members ran different steps: the ones behind are brought forward
            self._roll_back(f"step {step} did not commit")
            self.faults.at_width(None)
            self._resync = True
            self._last_failure = "the members ran different steps"
            self.events.log(Event.DESYNC, step=step, members=list(m.process_ids))
            logger.warning("process %d: the members ran different steps (this one: %d); the step fails and "
                           "the next one brings every member to the latest committed step", self.group.process_id,
                           step)
            return None
        except _Refused as e:  # a joiner's state does not match the members': it leaves, they go on
            self._last_failure = str(e)
            self.events.log(Event.STEP_FAILED, step=step, failed=list(e.processes), cause=str(e))
            return None
        except runner_lib.Abandoned as e:  # left a program no member failed in: the others may commit it
            self.events.log(Event.ABANDONED_WITHOUT_FAILURE, step=step, why=str(e))
            logger.error("process %d left step %d's program, but no member failed; exiting to rejoin",
                         self.group.process_id, step)
            os._exit(EXIT_HUNG)
        except _Reached:
            return None
        except _Skip:
            self.events.log(Event.STEP_WAITING, step=step, members=list(self._too_few), min_members=self.min_members)
            if verdict is not None:  # every member left this step alive: all admit the same joiners
                self._admit(m, verdict, step)
            return None
        except BaseException:  # (last: after the step's own exceptions)
            self._leave_ahead(f"step {step} raised")
            raise
        self._resync = False
        if defer:  # run, not yet committed: the next commit query commits it, or it is undone
            if not self._pending:
                self._before_pending = (self.step, self.state, self._global)
            self.step, self.state = step + 1, new_state
            self._global = (tuple(d.id for d in m.devices), jax.tree_util.tree_leaves(new_state), new_global)
            self.last_metrics = scalars
            self._pending.append(StepRecord(step, scalars.get("loss"), m.process_ids, self.group.generation,
                                            dict(m.incarnations), scalars))
            return None
        if rehydrated is not None:
            self.events.log(Event.JOIN, step=rehydrated.from_step, process=self.group.process_id)
            self.events.log(Event.REHYDRATED, **dataclasses.asdict(rehydrated))
        self.step, self.state = step + 1, new_state
        self._global = (tuple(d.id for d in m.devices), jax.tree_util.tree_leaves(new_state), new_global)
        self.last_metrics = scalars
        generation = self.group.generation  # agreed with the donor's after a rejoin
        record = StepRecord(step, scalars.get("loss"), m.process_ids, generation, dict(m.incarnations), scalars)
        committed, self._pending, self._before_pending = self._pending + [record], [], None
        for r in committed:  # (with commit_every, the steps run since the last commit, then this one)
            self.events.log(Event.COMMIT, step=r.step, members=list(r.members), generation=r.generation, loss=r.loss)
        if m.reset:  # where a recovery's time goes: the rebuild, then the program (compiled or loaded)
            self.events.log(Event.DATA_PLANE, step=step, program_s=round(t_program, 4), **self.group.last_reset,
                            programs_loaded=self.executables.loads, programs_compiled=self.executables.compiles)
        if verdict is not None:  # (held at a member's last step: nobody is admitted then)
            self._admit(m, verdict, step + 1)
        self._publish_signature(m)
        self._warm_up(m)
        if self.on_commit is not None:
            self.settle()  # (a hook may run programs of its own: none may run beside the step's)
            self.on_commit(self, record)
        for r in committed:
            self.faults.point("after-commit", r.step)
        return record

    def log_final(self, params: PyTree | None = None) -> dict:
        """Log the ``final`` event with the sha256 of ``params`` (default: the state's ``params``
        field or key if it has one, else the whole state)."""
        tree = params
        if tree is None:
            s = self.state
            tree = s["params"] if isinstance(s, dict) and "params" in s else getattr(s, "params", s)
        return self.events.log(Event.FINAL, step=self.step, params_sha256=transfer.tree_sha256(tree),
                               params_norm=transfer.tree_norm(tree), loss=self.last_loss,
                               abandoned_programs=self._runner.abandoned_total,
                               **({"started_early": self.started_early, "left_early": self.left_early}
                                  if self.pipeline else {}),
                               **({"deferred": self.group.deferred, "rolled_back": self.rolled_back}
                                  if self.commit_every > 1 else {}))

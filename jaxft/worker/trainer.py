"""``ElasticTrainer``: data-parallel training that survives process failures.

Each step runs inside one :meth:`ElasticGroup.step`: the global batch of the step is
split over the live devices, gradients are summed over them and divided by the global
batch size, and the new state is committed only if every member finished. A failed step
is retried on the survivors with the same batch, so the run computes what a run without
failures computes. A restarted process is detected inside the step and rehydrated from
the lowest-numbered member holding the latest step.

It is a thin user of :class:`jaxft.ElasticLoop` (bring your own step): its step is
:func:`jaxft.worker.train_step.make_train_step` and its state the pytree ``{"params", "opt_state"}``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxft.types import PyTree
from jaxft.worker.data import GlobalBatches
from jaxft.worker.loop import ElasticLoop, StepRecord
from jaxft.worker.options import Batching, LoopOptions, MeshStep, Reduction
from jaxft.worker.train_step import LossFn, chunk_size, make_train_step

if TYPE_CHECKING:
    from jaxft.worker.runtime import Runtime


@dataclasses.dataclass
class TrainState:
    """The committed state: everything needed to continue exactly."""

    step: int
    params: PyTree
    opt_state: PyTree


class ElasticTrainer:
    """The elastic data-parallel loop: a loss function and an optax optimizer on
    :class:`~jaxft.ElasticLoop`.

    Args:
      loss_fn: ``(params, batch) -> per-example losses [B]`` (the trainer masks padding and
        normalises by the global batch size).
      optimizer: any optax transformation.
      params: initial parameters (every process must pass the same values).
      data: the :class:`GlobalBatches` to train on.
      runtime: what :func:`jaxft.initialize` returned (events and fault points).
      on_commit: ``(trainer, record)`` after every commit.
      options: :class:`~jaxft.LoopOptions` (retries, admission, pipeline, commit batching,
        checks, warm-up).
      reduction: :class:`~jaxft.Reduction`: how the gradients are summed over the members (the
        all-reduce, whose float order depends on the width: ~1e-6 relative from a fault-free
        run; or fixed chunks summed in float64, or gathered, for the fault-free bits), and the
        micro-batch of gradient accumulation. A chunked reduction does useful work on at most
        ``chunks`` devices; a width that does not divide it runs padding chunks.
    """

    def __init__(self, loss_fn: LossFn, optimizer: optax.GradientTransformation, params: PyTree,
                 data: GlobalBatches, *, runtime: Runtime | None = None,
                 on_commit: Callable[[ElasticTrainer, StepRecord], None] | None = None,
                 options: LoopOptions = LoopOptions(), reduction: Reduction = Reduction()):
        chunk = chunk_size(reduction, data.global_batch)
        self.reduction = reduction
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.data = data
        self.on_commit = on_commit
        hook = (lambda _loop, record: on_commit(self, record)) if on_commit is not None else None
        step = MeshStep(self._make_step, takes_votes=reduction.kind != "exact")
        batching = Batching(micro_batch=reduction.micro_batch, stacked=True, chunk=chunk)
        self.loop = ElasticLoop(step, {"params": params, "opt_state": _init(optimizer, params)}, data, runtime=runtime,
                                on_commit=hook, options=options, batching=batching)
        self.events, self.faults, self.group = self.loop.events, self.loop.faults, self.loop.group
        self._view: TrainState | None = None  # what `state` returned, and what it was made from
        self._view_src: tuple = ()

    def _make_step(self, mesh: Mesh) -> Callable:
        if self.reduction.kind != "exact" and self.loop.group.admission == "ready":
            inner = make_train_step(self.loss_fn, self.optimizer, self.data.global_batch, mesh, self.reduction,
                                    votes=True)

            def step_with_votes(state, batch, mask, votes):
                params, opt_state, loss, agreed = inner(state["params"], state["opt_state"], batch, mask, votes)
                return {"params": params, "opt_state": opt_state}, {"loss": loss}, agreed

            return jax.jit(step_with_votes, out_shardings=NamedSharding(mesh, P()))
        inner = make_train_step(self.loss_fn, self.optimizer, self.data.global_batch, mesh, self.reduction)

        def step(state, batch, mask):
            params, opt_state, loss = inner(state["params"], state["opt_state"], batch, mask)
            return {"params": params, "opt_state": opt_state}, {"loss": loss}

        return step

    # -- state --------------------------------------------------------------------------
    @property
    def state(self) -> TrainState:
        """The committed state (assigning to its fields changes what the next step starts from);
        with ``commit_every``, that of the last step run, which may still be pending (``loop.pending``)."""
        src = (self.loop.step, self.loop.state["params"], self.loop.state["opt_state"])
        if self._view is None or not self._same(self._view_src, src):
            self._view, self._view_src = TrainState(*src), src
        return self._view

    @staticmethod
    def _same(a: tuple, b: tuple) -> bool:
        return a[0] == b[0] and a[1] is b[1] and a[2] is b[2]

    def _pull_view(self) -> None:
        """Adopt changes the caller made to the fields of :attr:`state` since the last commit."""
        v = self._view
        if v is None:
            return
        src = (self.loop.step, self.loop.state["params"], self.loop.state["opt_state"])
        if self._same(self._view_src, src) and not self._same((v.step, v.params, v.opt_state), src):
            self.loop.restore(v.step, {"params": v.params, "opt_state": v.opt_state})
        self._view = None

    def restore(self, state: TrainState) -> None:
        """Start from ``state`` (e.g. a checkpoint) instead of the initial one."""
        self._view = None
        self.loop.restore(state.step, {"params": state.params, "opt_state": state.opt_state})

    @property
    def last_loss(self) -> float | None:
        return self.loop.last_loss

    # -- the loop -----------------------------------------------------------------------
    def run(self, num_steps: int) -> TrainState:
        """Train until ``num_steps`` steps are committed; returns the final state (see
        :meth:`ElasticLoop.run` for what happens with too few members or a late start)."""
        self.loop.run(num_steps, before_attempt=self._pull_view)
        return self.state

    def try_step(self) -> StepRecord | None:
        """One attempt at the next step: the record of the commit it made, or None if it made
        none (it failed; or, with ``commit_every``, it ran and its commit is left to a later step)."""
        self._pull_view()
        return self.loop.try_step()

    def settle(self) -> None:
        """See :meth:`ElasticLoop.settle` (``pipeline``)."""
        self.loop.settle()

    def log_final(self) -> dict:
        return self.loop.log_final(self.loop.state["params"])


def _init(optimizer: optax.GradientTransformation, params: PyTree) -> PyTree:
    """``optimizer.init(params)`` as one jitted program: op by op, each leaf shape compiled a
    program of its own in every process at start-up (measured: docs/benchmarks.md, 'Figures
    behind the code'). An init that cannot be traced (host-side values) runs op by op, as it is."""
    try:
        return jax.jit(optimizer.init)(params)
    except jax.errors.JAXTypeError:
        return optimizer.init(params)

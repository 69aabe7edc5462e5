"""``ElasticTrainer``: data-parallel training that survives process failures.

Each step runs inside one :meth:`ElasticGroup.step`: the global batch of the step is
split over the live devices, gradients are summed over them and divided by the global
batch size, and the new state is committed only if every member finished. A failed step
is retried on the survivors with the same batch, so the run computes what a run without
failures computes. A restarted process is detected inside the step and rehydrated from
the lowest-numbered member holding the latest step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxft import rejoin, transfer
from jaxft.data import GlobalBatches, shard_batch
from jaxft.errors import ConsistencyError, StepFailed
from jaxft.events import EventLog
from jaxft.faults import FaultInjector
from jaxft.membership import ElasticGroup, Members
from jaxft.types import PyTree

LossFn = Callable[[PyTree, PyTree], jax.Array]  # (params, batch[B, ...]) -> per-example loss [B]


@dataclasses.dataclass
class TrainState:
    """The committed state: everything needed to continue exactly."""

    step: int
    params: PyTree
    opt_state: PyTree


@dataclasses.dataclass
class StepRecord:
    step: int
    loss: float
    members: tuple[int, ...]
    generation: int
    incarnations: dict[int, int] = dataclasses.field(default_factory=dict)  # process -> service incarnation


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, global_batch: int,
                    mesh: Mesh, with_votes: bool = False) -> Callable:
    """Jitted ``(params, opt_state, batch[M, D*m, ...], mask[M, D*m]) -> (params, opt_state, loss)``.

    Scans over the ``M`` micro-batches, summing per-example losses times the mask, and
    divides by ``global_batch``: the gradient does not depend on how many devices hold
    the batch. The cross-device sum is the all-reduce XLA inserts for the replicated
    params.

    With ``with_votes`` it also takes ``votes[D, P]`` (one row per device, sharded) and
    returns their max over devices, replicated: admission votes agreed inside the step's
    own collectives (:mod:`jaxft.admission`), at no extra round trip.
    """
    replicated = NamedSharding(mesh, P())

    def step(params, opt_state, batch, mask):
        def micro(carry, xs):
            grad_sum, loss_sum = carry
            b, m = xs
            loss, grads = jax.value_and_grad(lambda p: jnp.sum(loss_fn(p, b) * m))(params)
            return (jax.tree_util.tree_map(jnp.add, grad_sum, grads), loss_sum + loss), None

        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        carry = (zeros, jnp.zeros((), jnp.float32))
        if mask.shape[0] == 1:  # no accumulation: skip the loop (XLA:CPU runs loop bodies slower)
            (grad_sum, loss_sum), _ = micro(carry, jax.tree_util.tree_map(lambda x: x[0], (batch, mask)))
        else:
            (grad_sum, loss_sum), _ = jax.lax.scan(micro, carry, (batch, mask))
        grads = jax.tree_util.tree_map(lambda g: g / global_batch, grad_sum)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_sum / global_batch

    if not with_votes:
        return jax.jit(step, out_shardings=(replicated, replicated, replicated))

    def step_with_votes(params, opt_state, batch, mask, votes):
        return (*step(params, opt_state, batch, mask), jnp.max(votes, axis=0))

    return jax.jit(step_with_votes, out_shardings=(replicated,) * 4)


def _votes_array(votes: np.ndarray, mesh: Mesh, axis_name: str) -> jax.Array:
    """This process's vote row on each of its devices, as a global ``[D, P]`` array."""
    n = mesh.devices.size
    rows = np.broadcast_to(votes, (n, votes.size))
    return jax.make_array_from_callback((n, votes.size), NamedSharding(mesh, P(axis_name)), lambda i: rows[i])


def _replicate(tree: PyTree, mesh: Mesh) -> PyTree:
    """A replicated global view of this process's copy (no data moves between processes)."""
    sharding = NamedSharding(mesh, P())
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]

    def one(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        return jax.make_array_from_single_device_arrays(np.shape(x), sharding,
                                                        [jax.device_put(x, d) for d in local])

    return jax.tree_util.tree_map(one, tree)


def _local(tree: PyTree) -> PyTree:
    """This process's copy of a replicated tree, as single-device arrays."""
    return jax.tree_util.tree_map(lambda x: x.addressable_data(0), tree)


def _to_host(tree: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda x: np.array(x), tree)


class ElasticTrainer:
    """The elastic data-parallel loop.

    Args:
      loss_fn: ``(params, batch) -> per-example losses [B]`` (the trainer masks padding
        and normalises by the global batch size).
      optimizer: any optax transformation.
      params: initial parameters (every process must pass the same values).
      data: the :class:`GlobalBatches` to train on.
      runtime: what :func:`jaxft.initialize` returned (events and fault points).
      micro_batch: examples per device per micro-batch (gradient accumulation), or None.
      check_every: every N steps, verify that all members hold bitwise-identical params.
    """

    def __init__(self, loss_fn: LossFn, optimizer: optax.GradientTransformation, params: PyTree,
                 data: GlobalBatches, *, runtime=None, events: EventLog | None = None,
                 faults: FaultInjector | None = None, micro_batch: int | None = None,
                 check_every: int = 0, group: ElasticGroup | None = None,
                 on_commit: Callable[["ElasticTrainer", StepRecord], None] | None = None):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.data = data
        self.micro_batch = micro_batch
        self.check_every = check_every
        self.events = events or (runtime.events if runtime is not None else EventLog(None, jax.process_index()))
        self.faults = faults or (runtime.faults if runtime is not None else FaultInjector([], jax.process_index()))
        # admission="ready" (experimental, see jaxft.admission) needs the votes this loop carries.
        self.group = group or ElasticGroup()
        self._votes = self.group.admission == "ready"
        self.on_commit = on_commit
        self.state = TrainState(0, params, optimizer.init(params))
        self.last_loss: float | None = None
        self._steps: dict[tuple[int, ...], Callable] = {}
        # The last step's replicated outputs, reused while the members stay the same.
        self._global: tuple | None = None  # (device ids, params, opt_state, their global views)
        self.group.on_reset(before=self._state_to_host, after=self._steps.clear)

    # -- state --------------------------------------------------------------------------
    def _state_to_host(self) -> None:
        self._global = None
        s = self.state
        self.state = TrainState(s.step, _to_host(s.params), _to_host(s.opt_state))

    def restore(self, state: TrainState) -> None:
        """Start from ``state`` (e.g. a checkpoint) instead of the initial one."""
        self.state = state

    def _train_step(self, members: Members) -> Callable:
        key = tuple(d.id for d in members.devices)
        fn = self._steps.get(key)
        if fn is None:
            fn = make_train_step(self.loss_fn, self.optimizer, self.data.global_batch, members.mesh,
                                 with_votes=self._votes)
            self._steps[key] = fn
        return fn

    def _replicated(self, state: TrainState, m: Members) -> tuple[PyTree, PyTree]:
        """``state`` as replicated global arrays on ``m.mesh``; free when the last step's
        outputs already are exactly that."""
        g = self._global
        if (g is not None and g[0] == tuple(d.id for d in m.devices) and g[1] is state.params
                and g[2] is state.opt_state):
            return g[3], g[4]
        return _replicate(state.params, m.mesh), _replicate(state.opt_state, m.mesh)

    # -- joiners ------------------------------------------------------------------------
    def _sync_state(self, m: Members) -> tuple[TrainState, rejoin.Rehydration | None]:
        """Agree on the step; rehydrate members behind the latest one from a donor (see jaxft.rejoin)."""
        s = self.state
        steps, self.group.generation = rejoin.agree_steps(s.step, self.group.generation, m)
        step, tree, info = rejoin.rehydrate(s.step, {"params": s.params, "opt_state": s.opt_state}, m,
                                            self.group.process_id, steps)
        if info is None and step == s.step:
            return s, info
        return TrainState(step, tree["params"], tree["opt_state"]), info

    # -- the loop -----------------------------------------------------------------------
    def run(self, num_steps: int) -> TrainState:
        """Train until ``num_steps`` steps are committed; returns the final state."""
        while self.state.step < num_steps:
            self.try_step()
        self.group.finish()
        self.log_final()
        return self.state

    def try_step(self) -> StepRecord | None:
        """One attempt at the next step; None if it failed (nothing was committed)."""
        step = self.state.step
        self.faults.point("before-step", step)
        try:
            with self.group.step() as m:
                state, rehydrated = (self._sync_state(m) if m.gained else (self.state, None))
                step = state.step
                fn = self._train_step(m)
                batch, mask = shard_batch(self.data.batch(step), m.mesh, self.group.axis_name, self.micro_batch)
                if self._votes:
                    votes = _votes_array(self.group.votes(m), m.mesh, self.group.axis_name)
                    params, opt_state, loss, agreed = fn(*self._replicated(state, m), batch, mask, votes)
                    agreed = np.asarray(agreed.addressable_data(0))
                else:
                    params, opt_state, loss = fn(*self._replicated(state, m), batch, mask)
                jax.block_until_ready((params, opt_state, loss))
                self.faults.point("after-grad", step)
                new_params = _local(params)
                if self.check_every and (step + 1) % self.check_every == 0:
                    bad = transfer.check_consistent(new_params, m.mesh)
                    if bad:
                        raise ConsistencyError(step + 1, bad)
                loss = float(np.asarray(loss.addressable_data(0)))
        except StepFailed as e:
            self.events.log("step_failed", step=step, failed=list(e.failed),
                            cause=str(e.cause).splitlines()[0][:300] if e.cause else "membership changed")
            return None
        if rehydrated is not None:
            self.events.log("join", step=rehydrated.from_step, process=self.group.process_id)
            self.events.log("rehydrated", **dataclasses.asdict(rehydrated))
        self.state = TrainState(step + 1, new_params, _local(opt_state))
        self._global = (tuple(d.id for d in m.devices), self.state.params, self.state.opt_state,
                        params, opt_state)
        self.last_loss = loss
        generation = self.group.generation  # agreed with the donor's after a rejoin
        record = StepRecord(step, loss, m.process_ids, generation, dict(m.incarnations))
        self.events.log("commit", step=step, members=list(m.process_ids), generation=generation, loss=loss)
        if self._votes:
            admitted = self.group.admit(m, agreed)
            if admitted:
                self.events.log("admit", step=step + 1, joiners=list(admitted))
        if self.on_commit is not None:
            self.on_commit(self, record)
        self.faults.point("after-commit", step)
        return record

    def log_final(self) -> dict:
        params = self.state.params
        return self.events.log("final", step=self.state.step, params_sha256=transfer.tree_sha256(params),
                               params_norm=transfer.tree_norm(params), loss=self.last_loss)

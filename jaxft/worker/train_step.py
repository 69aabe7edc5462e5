"""The step of :class:`~jaxft.ElasticTrainer`: a loss function and an optax optimizer, with the
gradients summed over the members by one of three reductions (:class:`~jaxft.Reduction`).

Every reduction sums per-example losses times the mask and divides by the global batch, so
the gradient does not depend on how many devices hold the batch (up to float rounding for
the all-reduce; bit for bit for ``"exact"``). Gradients are accumulated in float32 for
low-precision params (one rounding at the end), and handed to the optimizer in the params'
dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxft.types import PyTree
from jaxft.worker.options import Reduction
from jaxft.worker.programs import agreed_votes

LossFn = Callable[[PyTree, PyTree], jax.Array]  # (params, batch[B, ...]) -> per-example loss [B]


def _per_example(loss: jax.Array, mask: jax.Array) -> jax.Array:
    """Check (at trace time) that ``loss_fn`` returned one loss per example: a ``[B, 1]``
    loss would silently broadcast against the ``[B]`` mask into ``[B, B]``."""
    if loss.shape != mask.shape:
        raise ValueError(f"loss_fn must return one loss per example, shape {tuple(mask.shape)}; it returned "
                         f"shape {tuple(loss.shape)} (reduce the other axes, e.g. jnp.sum(..., axis=-1))")
    return loss


CHUNKED = ("allreduce64", "exact")  # the reductions that lay the batch out in fixed chunks


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, global_batch: int,
                    mesh: Mesh, reduction: Reduction = Reduction(), votes: bool = False) -> Callable:
    """Jitted ``(params, opt_state, batch[M, D*m, ...], mask[M, D*m]) -> (params, opt_state, loss)``.

    ``votes`` (the all-reduces only): the step also takes the admission votes ``[D, P]``
    (sharded over the devices) and returns ``agreed [P]`` (:func:`jaxft.worker.programs.agreed_votes`),
    the votes summed in the same buffer as the gradients.

    Sums per-example losses times the mask and divides by ``global_batch``: the gradient
    does not depend on how many devices hold the batch, up to float rounding.

    ``Reduction("allreduce")``: scans over the ``M`` micro-batches; the cross-device sum is one
    all-reduce of every gradient and the loss in one buffer (its order depends on the width).
    ``Reduction("allreduce64", chunks=C)``: the batch must be laid out by
    :meth:`jaxft.Layout.chunked` in ``C`` chunks; each chunk's gradient is summed in float64 by
    one all-reduce and rounded once (see :func:`_allreduce_step`).
    ``Reduction("exact", chunks=C)``: the same layout; the result is bitwise independent of the
    number of devices (see :func:`_exact_step`).
    """
    chunk_size(reduction, global_batch)  # (checks chunks)
    if reduction.kind == "exact":
        if votes:
            raise ValueError("votes are summed in the step only with the all-reduces")
        step = _exact_step(loss_fn, optimizer, global_batch, int(reduction.chunks or 0), mesh)
    else:
        step = _allreduce_step(loss_fn, optimizer, global_batch, mesh, votes, wide=reduction.kind == "allreduce64")
    replicated = NamedSharding(mesh, P())
    return jax.jit(step, out_shardings=(replicated,) * (4 if votes else 3))


def _chunk_value_and_grad(loss_fn: LossFn, params: PyTree, batch: PyTree, mask: jax.Array):
    """Masked loss sum of one micro-batch and its gradient."""
    return jax.value_and_grad(lambda p: jnp.sum(_per_example(loss_fn(p, batch), mask) * mask))(params)


def _acc_dtype(dtype) -> np.dtype:
    """The dtype a gradient leaf is summed in: float32 for floats narrower than 32 bits (a
    bfloat16 running sum keeps 8 bits, so its error grows with the number of micro-batches,
    which depends on the width), a leaf's own dtype otherwise."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype


def _widen(tree: PyTree) -> PyTree:
    """``tree``'s leaves in their :func:`_acc_dtype` (float32 and float64 leaves untouched)."""
    return jax.tree_util.tree_map(lambda x: x if _acc_dtype(x.dtype) == x.dtype else x.astype(_acc_dtype(x.dtype)),
                                  tree)


def _loss_dtype(params: PyTree) -> np.dtype:
    """The dtype the micro-batches' losses are summed in: float32, or float64 with float64 params."""
    return np.dtype(jnp.result_type(np.float32, *(_acc_dtype(x.dtype) for x in jax.tree_util.tree_leaves(params))))


def _chunk_grads(loss_fn: LossFn, params: PyTree, batch: PyTree, mask: jax.Array) -> tuple[jax.Array, PyTree]:
    """Losses ``[k]`` and gradients ``[k, ...]`` of this device's ``k`` chunks, each from the
    same loop body on a ``[G/C, ...]`` slice whichever device runs it (so the same bits).

    The loop always runs >= 2 iterations (a device holding one chunk runs it twice and keeps
    one): with a trip count of 1, XLA:CPU drops the loop and compiles the chunk's gradient
    differently (measured: docs/benchmarks.md, 'Figures behind the code')."""
    k = mask.shape[0]
    if k == 1:
        batch, mask = jax.tree_util.tree_map(lambda x: jnp.concatenate([x, x]), (batch, mask))
    losses, grads = jax.lax.map(lambda xs: _chunk_value_and_grad(loss_fn, params, *xs), (batch, mask))
    return losses[:k], jax.tree_util.tree_map(lambda x: x[:k], grads)


def _wide_sum(loss_fn: LossFn, params: PyTree, batch: PyTree, mask: jax.Array) -> tuple[PyTree, jax.Array]:
    """This device's chunks' gradients and losses summed in float64: leaves ``[1, ...]``.

    A scan whose float64 carry takes each chunk's gradient as it comes (materialising the
    ``k`` gradients first, as :func:`_chunk_grads` does, made the step several times slower
    on XLA:CPU; measured: docs/benchmarks.md, 'Figures behind the code'). It runs >= 2
    iterations for the reason given there: a device holding one chunk runs a second,
    all-padding one (mask 0, so it adds exact zeros). The user's loss is traced with the x64
    setting the user's program has."""
    if mask.shape[0] == 1:
        batch = jax.tree_util.tree_map(lambda x: jnp.concatenate([x, x]), batch)
        mask = jnp.concatenate([mask, jnp.zeros_like(mask)])
    users_x64 = bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]  # (jax's flags: no stubs)
    with jax.enable_x64(True):
        def body(acc, xs):
            with jax.enable_x64(users_x64):
                loss, grads = _chunk_value_and_grad(loss_fn, params, *xs)
            return jax.tree_util.tree_map(lambda a, x: a + x.astype(jnp.float64), acc, (grads, loss)), None

        zero = jax.tree_util.tree_map(lambda x: jnp.zeros((1,) + x.shape, jnp.float64),
                                      (params, jnp.zeros((), jnp.float32)))
        acc, _ = jax.lax.scan(body, zero, (batch, mask))
    return acc


def _allreduce_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, global_batch: int,
                    mesh: Mesh, votes: bool = False, wide: bool = False) -> Callable:
    """Each device sums its micro-batches' gradients and losses, then one ``psum`` of them all
    (and of the admission votes, with ``votes``) flattened into one buffer (:func:`_rows`):
    one gloo all-reduce per step. XLA's CPU backend runs a tuple all-reduce (what it made of
    the per-leaf sums) as one gloo all-reduce per element, all on one slot: when a member died
    between two of them, a survivor one element ahead sent chunks of the wrong size and
    another survivor aborted in gloo ("op.preamble.length <= op.nbytes. 32 vs 4", SIGABRT).
    Gradients of floats narrower than 32 bits are summed, and all-reduced, in float32
    (:func:`_acc_dtype`), and rounded to their dtype once, by :func:`_apply`.

    ``wide`` (``reduction="allreduce64"``): the micro-batches are the fixed chunks of
    :meth:`jaxft.Layout.chunked`, whose gradients have the same bits on every width; they are
    summed in float64 on the device (:func:`_wide_sum`) and by the all-reduce, and rounded
    once to the leaves' dtype (float32 for narrower floats, which :func:`_apply` rounds to
    theirs after the division by the global batch). A float64 sum of ``C`` float32 values is
    exact unless their exponents span more than ~29 - log2(C) bits, and otherwise off by far
    less than a float32 ulp, so the rounded sum differs between widths only when it lies within ~2^-53 of a
    float32 rounding boundary: in practice the fault-free run's bits, where ``"allreduce"``
    ends ~1e-6 relative apart (measured: docs/benchmarks.md, 'Figures behind the code').
    Cost: the all-reduce moves twice the bytes, and the batch runs in chunks.
    """
    axis = mesh.axis_names[0]

    def per_device(params, batch, mask, *vote_rows):  # batch [M, m, ...]: this device's micro-batches
        if wide:
            grad_sum, loss_sum = _wide_sum(loss_fn, params, batch, mask)
            with jax.enable_x64(True):
                flat, unflatten = _rows((grad_sum, loss_sum) + tuple(v.astype(jnp.float64) for v in vote_rows))
                total = unflatten(jax.lax.psum(flat, axis))
                grad_sum = jax.tree_util.tree_map(lambda t, x: t[0].astype(_acc_dtype(x.dtype)), total[0], params)
                rest = tuple(t[0].astype(jnp.float32) for t in total[1:])  # the loss, the votes
            return (grad_sum,) + rest

        def micro(carry, xs):
            grad_sum, loss_sum = carry
            loss, grads = _chunk_value_and_grad(loss_fn, params, *xs)
            grad_sum = jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), grad_sum, grads)
            return (grad_sum, loss_sum + loss.astype(loss_sum.dtype)), None

        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros_like(p, dtype=_acc_dtype(p.dtype)), params)
        carry = (zeros, jnp.zeros((), _loss_dtype(params)))
        if mask.shape[0] == 1:  # no accumulation: skip the loop (XLA:CPU runs loop bodies slower)
            (grad_sum, loss_sum), _ = micro(carry, jax.tree_util.tree_map(lambda x: x[0], (batch, mask)))
        else:
            (grad_sum, loss_sum), _ = jax.lax.scan(micro, carry, (batch, mask))
        rows = jax.tree_util.tree_map(lambda x: x[None], (grad_sum, loss_sum))
        rows += tuple(v.astype(jnp.float32) for v in vote_rows)  # this device's votes [1, P]
        flat, unflatten = _rows(rows)
        return jax.tree_util.tree_map(lambda x: x[0], unflatten(jax.lax.psum(flat, axis)))

    specs = (P(), P(None, axis), P(None, axis)) + ((P(axis),) if votes else ())
    summed = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)

    if not votes:
        def step(params, opt_state, batch, mask):
            grad_sum, loss_sum = summed(params, batch, mask)
            return _apply(optimizer, params, opt_state, grad_sum, loss_sum, global_batch)

        return step

    def step_with_votes(params, opt_state, batch, mask, votes_in):
        grad_sum, loss_sum, total = summed(params, batch, mask, votes_in)
        return _apply(optimizer, params, opt_state, grad_sum, loss_sum, global_batch) + (agreed_votes(total),)

    return step_with_votes


def _apply(optimizer, params, opt_state, grad_sum, loss_sum, global_batch: int):
    """Divide the summed gradients (in their :func:`_acc_dtype`) by the global batch, round
    them to the params' dtypes there, once, and update.

    The optimizer gets gradients in the params' dtypes, not float32: its state was made by
    ``optimizer.init(params)`` in those dtypes, and float32 gradients would promote it (adam's
    moments, say) to float32 at the first update, so the committed state would change dtypes
    (a second compile, a checkpoint or a rehydration whose tree no longer matches). Whoever
    wants float32 optimizer arithmetic keeps float32 master params and casts in the loss."""
    grads = jax.tree_util.tree_map(lambda g, p: (g / global_batch).astype(p.dtype), grad_sum, params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss_sum / global_batch


def _exact_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, global_batch: int, chunks: int,
                mesh: Mesh) -> Callable:
    """The width-independent step: every chunk's gradient comes from the same loop body on a
    ``[G/chunks, ...]`` slice, whichever device runs it; the ``chunks`` gradients are
    all-gathered in chunk order and summed in one fixed sequential order on every device.

    Measured on XLA:CPU (jax 0.10.2), each guard below was needed for equal bits:
    * the chunk loop always runs >= 2 iterations (:func:`_chunk_grads`);
    * optimization barriers around the gathered gradients and their sum: on one device the
      gather is a no-op, and fusing the update into the producers changed the rounding.
    Cost: each device holds ``chunks`` gradients (``chunks x params`` floats) after the gather,
    which is one all-gather of every leaf flattened into one buffer (:func:`_rows`).
    """
    axis = mesh.axis_names[0]

    def per_device(params, batch, mask):  # batch [k, c, ...]: this device's chunks, in order
        flat, unflatten = _rows(_widen(_chunk_grads(loss_fn, params, batch, mask)))
        gathered = jax.lax.all_gather(flat, axis, tiled=True)[:chunks]  # drop padding chunks
        return jax.lax.optimization_barrier(unflatten(gathered))

    gathered = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(None, axis), P(None, axis)), out_specs=P(),
                             check_vma=False)

    def step(params, opt_state, batch, mask):
        losses, grads = gathered(params, batch, mask)
        grad_sum, loss_sum = jax.lax.optimization_barrier((_fold(grads), _fold(losses)))
        return _apply(optimizer, params, opt_state, grad_sum, loss_sum, global_batch)

    return step


def _rows(tree: PyTree) -> tuple[jax.Array, Callable[[jax.Array], PyTree]]:
    """``tree``'s leaves ``[k, ...]`` as one ``[k, n]`` array (in one dtype every leaf's
    converts to exactly, e.g. bfloat16 and float32 -> float32), and the inverse for any
    leading size: the all-reduce sums one buffer and the exact reduction gathers one, so a
    step runs one gloo collective instead of one per leaf (each is another chance for peers
    to fall out of step when a member dies mid-step)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dtype = jnp.result_type(*leaves)
    sizes = [int(np.prod(x.shape[1:], dtype=np.int64)) for x in leaves]
    flat = jnp.concatenate([x.reshape(x.shape[0], -1).astype(dtype) for x in leaves], axis=1)

    def unflatten(rows: jax.Array) -> PyTree:
        parts = jnp.split(rows, np.cumsum(sizes)[:-1], axis=1)
        return jax.tree_util.tree_unflatten(treedef, [
            part.reshape((rows.shape[0],) + x.shape[1:]).astype(x.dtype) for part, x in zip(parts, leaves)])

    return flat, unflatten


def _fold(tree: PyTree) -> PyTree:
    """Sum over the leading axis as a sequential left fold (a scan: one order, every width),
    in each leaf's :func:`_acc_dtype`."""
    def one(x):
        acc = _acc_dtype(x.dtype)
        return jax.lax.scan(lambda a, g: (a + g.astype(acc), None), jnp.zeros_like(x[0], dtype=acc), x)[0]

    return jax.tree_util.tree_map(one, tree)



def chunk_size(reduction: Reduction, global_batch: int) -> int | None:
    """The chunked reductions' chunk size ``G / chunks`` (None for the all-reduce), validated:
    ``chunks`` must divide the global batch, and such a reduction sets the micro-batch itself."""
    if reduction.kind not in CHUNKED:
        return None
    chunks = reduction.chunks
    if not chunks or global_batch % chunks:
        raise ValueError(f"reduction {reduction.kind!r} needs chunks, a number >= 1 dividing the global batch "
                         f"({global_batch}); got {chunks}")
    if reduction.micro_batch:
        raise ValueError(f"reduction {reduction.kind!r} sets the micro-batch itself (global_batch / chunks "
                         f"= {global_batch // chunks} examples); pass micro_batch=None")
    return global_batch // chunks

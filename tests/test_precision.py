"""The dtypes of a step's gradient sums: bfloat16 params' gradients are accumulated and reduced
in float32 and rounded to bfloat16 once; float64 params' losses are summed in float64.

In-process, one device: a step with ``G`` micro-batches (or chunks) of one example each,
whose summed gradient is compared with the exact sum rounded once to bfloat16.
"""

import numpy as np
import pytest

from jaxft import Reduction

G, N = 512, 64  # examples per step (each its own micro-batch), params


def _identity():
    """An optax transformation whose update is the gradient: the step's params become ``0 + g``."""
    import optax

    return optax.GradientTransformation(lambda params: optax.EmptyState(),
                                        lambda grads, state, params=None: (grads, state))


def _loss(params, batch):
    """Linear per-example loss: example ``i``'s gradient is ``x_i`` itself, exactly."""
    import jax.numpy as jnp

    return jnp.sum(params["w"] * batch["x"], axis=-1)


@pytest.mark.parametrize("reduction, chunks, micro", [("allreduce", None, 1), ("exact", G, None),
                                                      ("allreduce64", G, None)])
def test_bf16_gradients_of_many_micro_batches_are_summed_in_float32(reduction, chunks, micro):
    # Before: the allreduce's micro-batch scan and the exact reduction's fold added G bfloat16
    # gradients in bfloat16 (a running sum rounded to 8 bits at each micro-batch), so the
    # result depended on how many micro-batches a device ran. Now: float32 sums, one rounding.
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxft.worker.data import shard_batch
    from jaxft.worker.train_step import make_train_step

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    x = np.asarray(jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.0, (G, N)), jnp.bfloat16))
    params = jax.device_put({"w": jnp.zeros((N,), jnp.bfloat16)}, NamedSharding(mesh, P()))
    step = make_train_step(_loss, _identity(), G, mesh, Reduction(reduction, chunks=chunks))
    batch, mask = shard_batch({"x": x}, mesh, micro_batch=micro, chunk=G // chunks if chunks else None)
    new, _, _ = step(params, _identity().init(params), batch, mask)

    assert new["w"].dtype == jnp.bfloat16  # the params (and the optimizer's input) keep their dtype
    exact = x.astype(np.float64).sum(axis=0) / G  # (the bfloat16 inputs sum exactly in float32 too)
    want = np.asarray(jnp.asarray(exact, jnp.bfloat16)).astype(np.float64)
    got = np.asarray(new["w"]).astype(np.float64)
    off, worst = int(np.sum(got != want)), float(np.max(np.abs(got - exact) / exact))
    assert off == 0, f"{reduction}: {off} of {N} gradients not the exact sum rounded once; worst {worst:.2e} relative"


def test_bf16_params_and_their_optimizer_state_keep_their_dtype():
    # The optimizer gets gradients in the params' dtype (trainer._apply): float32 ones would
    # promote adam's bfloat16 moments to float32, and the committed state would change dtypes.
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxft.worker.data import shard_batch
    from jaxft.worker.train_step import make_train_step

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    x = np.random.default_rng(0).uniform(0.5, 1.0, (32, N)).astype(np.float32)
    params = jax.device_put({"w": jnp.ones((N,), jnp.bfloat16)}, NamedSharding(mesh, P()))
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)
    step = make_train_step(_loss, opt, 32, mesh)
    batch, mask = shard_batch({"x": x}, mesh, micro_batch=4)
    new, new_state, _ = step(params, opt_state, batch, mask)
    before = [leaf.dtype for leaf in jax.tree_util.tree_leaves((params, opt_state))]
    assert [leaf.dtype for leaf in jax.tree_util.tree_leaves((new, new_state))] == before


def test_float64_params_with_micro_batches_sum_their_losses_in_float64():
    # Before: the micro-batch scan carried the loss sum in float32 and a float64 loss made its
    # carry change dtype (a TypeError at trace time): float64 params ran only without micro-batches.
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxft.worker.data import shard_batch
    from jaxft.worker.train_step import make_train_step

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    x = np.random.default_rng(0).uniform(0.5, 1.0, (32, N))
    with jax.enable_x64(True):
        params = jax.device_put({"w": jnp.ones((N,), jnp.float64)}, NamedSharding(mesh, P()))
        step = make_train_step(_loss, optax.sgd(0.1), 32, mesh)
        batch, mask = shard_batch({"x": x}, mesh, micro_batch=4)
        new, _, loss = step(params, optax.sgd(0.1).init(params), batch, mask)
        assert (new["w"].dtype, loss.dtype) == (jnp.float64, jnp.float64)
        assert float(loss) == pytest.approx(x.sum() / 32, rel=1e-12)

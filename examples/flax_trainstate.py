"""Bring your own train step: a flax ``TrainState`` and an optax schedule, made elastic.

    python examples/flax_trainstate.py --steps 20                       # one process
    jaxft launch -n 3 --restart on-failure --run-dir runs/ts --fault kill:process=1:step=8 \
        -- python examples/flax_trainstate.py --steps 20

The step function and the state are yours (here a jittable ``train_step(state, batch,
mask)`` on a ``flax.training.train_state.TrainState`` with a warm-up + cosine learning-rate
schedule); :class:`jaxft.ElasticLoop` runs it inside the atomic step: the mesh over the live
processes, step k's global batch split over them, the retry on the survivors, the rehydration
of a restarted process (the whole ``TrainState``, step counter included) and the commit hook.
The data are scikit-learn's handwritten digits (shipped with the package, nothing downloaded).
"""

import os

from absl import app, flags, logging

import jaxft

flags.DEFINE_integer("steps", 20, "steps to train")
flags.DEFINE_integer("global_batch", 96, "examples per step, whatever the number of processes")
flags.DEFINE_float("step_sleep", 0.0, "seconds to sleep after each commit (to stretch demos and tests)")
flags.DEFINE_string("final_params", None, "write each process's final params to DIR/final-p<P>.npz")
flags.DEFINE_integer("seed", 0, "seed of the init and the data order")
flags.DEFINE_float("peak_lr", 1e-2, "peak learning rate of the warm-up + cosine schedule")
FLAGS = flags.FLAGS


def load_digits():
    import numpy as np
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    return {"x": (d.data / 16.0).astype(np.float32), "y": d.target.astype(np.int32)}  # [1797, 64]


def main(_):
    logging.set_verbosity(logging.WARNING)
    import time

    # Slow set-up that needs no JAX backend first (a restarted process joins when it connects).
    import flax.linen as nn
    import optax
    from flax.training import train_state

    data_arrays = load_digits()
    rt = jaxft.initialize()  # before any JAX computation
    import jax
    import jax.numpy as jnp
    import numpy as np

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))

    model = MLP()
    G = FLAGS.global_batch
    schedule = optax.warmup_cosine_decay_schedule(0.0, FLAGS.peak_lr, warmup_steps=5,
                                                  decay_steps=max(FLAGS.steps, 6))
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(FLAGS.seed), data_arrays["x"][:1])["params"],
        tx=optax.adamw(schedule))
    state = jax.tree_util.tree_map(np.array, state)  # host copies (see ElasticLoop: no jax arrays kept alive)

    def train_step(state, batch, mask):
        """Your step: the padding rows have mask 0; normalise by G, not by the rows present."""
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return jnp.sum(per_example * mask) / G

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, "lr": schedule(state.step)}

    def on_commit(loop, record):
        if FLAGS.step_sleep:
            time.sleep(FLAGS.step_sleep)
        if record.step % 5 == 0 or record.step == FLAGS.steps - 1:
            print(f"step {record.step:3d} loss {record.loss:.4f} lr {record.metrics['lr']:.5f} "
                  f"members {list(record.members)}", flush=True)

    data = jaxft.GlobalBatches(data_arrays, G, seed=FLAGS.seed)
    loop = jaxft.ElasticLoop(train_step, state, data, runtime=rt, on_commit=on_commit,
                             options=jaxft.LoopOptions(check_every=10))
    state = loop.run(FLAGS.steps)  # logs `final` with the sha256 of state.params
    if FLAGS.final_params:
        os.makedirs(FLAGS.final_params, exist_ok=True)
        jaxft.save_tree(os.path.join(FLAGS.final_params, f"final-p{rt.process_id}.npz"), state.params)
    print(f"done: step {loop.step} (TrainState.step {int(state.step)}) loss {loop.last_loss:.4f}", flush=True)


if __name__ == "__main__":
    app.run(main)

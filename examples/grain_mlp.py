"""Train from a Grain data source: each process loads only its own share of each step.

    python examples/grain_mlp.py --steps 20                             # one process
    jaxft launch -n 3 --restart on-failure --run-dir runs/grain --fault kill:process=1:step=8 \
        -- python examples/grain_mlp.py --steps 20

``RegressionSource`` stands for any random-access source (``__len__``, ``__getitem__``:
``grain.sources.ArrayRecordDataSource`` over your files, a ``MapDataset``, ...): here each
example is computed from its index, so nothing is held in memory. :class:`jaxft.GrainBatches`
gives step k the same global examples whatever the width (Grain's seeded per-epoch shuffle),
and each process reads only the examples its devices hold in that step, prefetched by Grain.
Needs ``pip install -e '.[grain]'``.
"""

import os

from absl import app, flags, logging

import jaxft

flags.DEFINE_integer("steps", 20, "steps to train")
flags.DEFINE_integer("global_batch", 96, "examples per step, whatever the number of processes")
flags.DEFINE_integer("num_examples", 2048, "size of the source")
flags.DEFINE_float("step_sleep", 0.0, "seconds to sleep after each commit (to stretch demos and tests)")
flags.DEFINE_string("final_params", None, "write each process's final params to DIR/final-p<P>.npz")
flags.DEFINE_integer("seed", 0, "seed of the init and of Grain's shuffle")
FLAGS = flags.FLAGS


class RegressionSource:
    """A random-access source: example i is ``(x_i, y_i)`` of a fixed random teacher."""

    def __init__(self, size: int, features: int = 16):
        import numpy as np

        rng = np.random.default_rng(1234)
        self.size, self.features = size, features
        self.w = (rng.normal(size=(features, 1)) / np.sqrt(features)).astype(np.float32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        import numpy as np

        x = np.random.default_rng([7, int(i)]).normal(size=self.features).astype(np.float32)
        return {"x": x, "y": np.tanh(x @ self.w).astype(np.float32)}


def main(_):
    logging.set_verbosity(logging.WARNING)
    import time

    import grain  # noqa: F401 - slow imports before joining the job
    import optax

    source = RegressionSource(FLAGS.num_examples)
    rt = jaxft.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np

    data = jaxft.GrainBatches(source, FLAGS.global_batch, seed=FLAGS.seed, num_threads=2, prefetch=2)
    k1, k2 = jax.random.split(jax.random.key(FLAGS.seed))
    params = {"w1": np.asarray(jax.random.normal(k1, (source.features, 32))) / 4, "b1": np.zeros(32, np.float32),
              "w2": np.asarray(jax.random.normal(k2, (32, 1))) / 6, "b2": np.zeros(1, np.float32)}

    def loss_fn(params, batch):  # per-example squared error [B]
        h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        return jnp.sum((h @ params["w2"] + params["b2"] - batch["y"]) ** 2, axis=-1)

    def on_commit(trainer, record):
        if FLAGS.step_sleep:
            time.sleep(FLAGS.step_sleep)
        if record.step % 5 == 0 or record.step == FLAGS.steps - 1:
            print(f"step {record.step:3d} loss {record.loss:.5f} members {list(record.members)}", flush=True)

    trainer = jaxft.ElasticTrainer(loss_fn, optax.adam(1e-2), params, data, runtime=rt, on_commit=on_commit,
                                   options=jaxft.LoopOptions(check_every=10))
    state = trainer.run(FLAGS.steps)
    if FLAGS.final_params:
        os.makedirs(FLAGS.final_params, exist_ok=True)
        jaxft.save_tree(os.path.join(FLAGS.final_params, f"final-p{rt.process_id}.npz"), state.params)
    print(f"done: step {state.step} loss {trainer.last_loss:.5f}", flush=True)


if __name__ == "__main__":
    app.run(main)

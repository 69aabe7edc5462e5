"""The JAX fault-tolerance guide's example 2 (survive and recover), on ``ElasticTrainer``.

The guide assumes process 0 never dies and always sends the weights to a recovering
process. Here any process may die, process 0 included: a restarted process is rehydrated
(step, weights, optimizer state) from the lowest-numbered member holding the latest step.

    jaxft launch -n 4 --restart on-failure --fault kill:process=0:step=10 \
        --fault kill:process=2:step=25 -- python examples/guide_recover.py
"""

import time

from absl import app, flags, logging
from guide_data import linear_data  # examples/ is on sys.path when run as a script

import jaxft

flags.DEFINE_integer("steps", 50, "steps to train")
flags.DEFINE_float("step_sleep", 0.0, "seconds to sleep after each commit (to stretch demos and tests)")
FLAGS = flags.FLAGS


def main(_):
    logging.set_verbosity(logging.WARNING)  # keep jax's INFO lines out of the workers' output
    rt = jaxft.initialize()
    import jax.numpy as jnp
    import numpy as np
    import optax

    data = linear_data()  # the same data as example 1
    def loss_fn(w, b):  # per-example loss
        return (w["a"] * b["x"] - b["y"]) ** 2

    on_commit = (lambda _trainer, _record: time.sleep(FLAGS.step_sleep)) if FLAGS.step_sleep else None
    trainer = jaxft.ElasticTrainer(loss_fn, optax.sgd(1e-6), {"a": np.float32(0.0)}, data, runtime=rt,
                                   on_commit=on_commit)
    state = trainer.run(FLAGS.steps)
    print(f"done: step {state.step}, a = {float(jnp.asarray(state.params['a'])):.4f}", flush=True)


if __name__ == "__main__":
    app.run(main)

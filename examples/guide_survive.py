"""The JAX fault-tolerance guide's example 1 (survive), on jaxft's low-level API.

A linear model ``y = a*x`` trained data-parallel. Each step runs in one atomic
``group.step()``: if a process dies during it, every survivor sees ``StepFailed`` and
retries the same step on the survivors. Unlike the guide, the batch does not shrink with
the number of processes: step k always uses the same 60 examples.

    jaxft launch -n 4 --fault kill:process=3:step=20 -- python examples/guide_survive.py
"""

from absl import app, flags, logging
from guide_data import linear_data  # examples/ is on sys.path when run as a script

import jaxft

flags.DEFINE_integer("steps", 50, "steps to train")
flags.DEFINE_float("learning_rate", 1e-6, "SGD learning rate")
FLAGS = flags.FLAGS


def main(_):
    logging.set_verbosity(logging.WARNING)  # keep jax's INFO lines out of the workers' output
    rt = jaxft.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    data = linear_data()

    def grad_fn(w, batch, mask):  # mean squared error over the real (unpadded) examples
        def loss(w):
            return jnp.sum(mask * (w * batch["x"] - batch["y"]) ** 2) / 60

        return jax.value_and_grad(loss)(w)

    group, weights, step = jaxft.ElasticGroup(), np.float32(0.0), 0
    while step < FLAGS.steps:
        try:
            with group.step() as m:
                batch, mask = jaxft.shard_batch(data.batch(step), m.mesh)
                w = jax.device_put(weights, NamedSharding(m.mesh, P()))
                loss, grad = jax.jit(grad_fn, out_shardings=NamedSharding(m.mesh, P()))(w, batch, mask)
                new = np.asarray(jax.block_until_ready(w - FLAGS.learning_rate * grad).addressable_data(0))
                rt.faults.point("after-grad", step)
        except jaxft.StepFailed as e:
            print(f"step {step} failed ({list(e.failed)} died); retrying on the survivors", flush=True)
            continue
        weights, step = new, step + 1
        rt.events.log("commit", step=step - 1, members=list(m.process_ids), generation=m.generation,
                      loss=float(np.asarray(loss.addressable_data(0))))
        if step % 10 == 0:
            print(f"step {step}: a = {float(weights):.4f} on processes {list(m.process_ids)}", flush=True)
    group.finish()


if __name__ == "__main__":
    app.run(main)

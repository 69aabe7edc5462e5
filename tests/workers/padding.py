"""Test worker: a loss that is NaN on all-zero inputs, trained where the global batch needs
padding (10 examples over 3 processes), or a loss of the wrong shape (``--bad_shape``)."""

import sys

import jaxft

rt = jaxft.initialize()

import jax.numpy as jnp
import numpy as np
import optax

rng = np.random.default_rng(0)
data = {"x": rng.normal(size=(40, 4)).astype(np.float32) + 2.0, "y": rng.normal(size=(40,)).astype(np.float32)}


def loss_fn(p, b):
    x = b["x"] / jnp.linalg.norm(b["x"], axis=-1, keepdims=True)  # 0/0 = NaN on a zero row
    err = (x @ p["w"] - b["y"]) ** 2
    return err[:, None] if "--bad_shape" in sys.argv else err


trainer = jaxft.ElasticTrainer(loss_fn, optax.sgd(0.1), {"w": np.zeros(4, np.float32)},
                               jaxft.GlobalBatches(data, 10, seed=0), runtime=rt)
state = trainer.run(6)
rt.events.log("padding_result", finite=bool(np.all(np.isfinite(state.params["w"]))),
              w=[float(v) for v in state.params["w"]])

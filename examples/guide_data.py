"""The data of the JAX fault-tolerance guide's examples: y = 10 x + noise, 60 per step."""

import numpy as np

import jaxft


def linear_data() -> jaxft.GlobalBatches:
    """600 points, shuffled once with seed 42; every step takes the same 60 examples."""
    rng = np.random.default_rng(42)
    x = rng.permutation(np.arange(-300.0, 300.0, dtype=np.float32))
    return jaxft.GlobalBatches({"x": x, "y": 10 * x + rng.normal(size=x.shape).astype(np.float32)}, 60)

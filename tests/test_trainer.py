"""jaxft.worker.trainer: the optimizer's initial state, made as one jitted program."""

import jax
import numpy as np
import optax

from jaxft.worker.trainer import _init


def test_the_optimizer_state_is_optaxs_own_and_a_host_side_init_still_runs():
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
    for tx in (optax.adam(1e-3), optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))):
        mine, theirs = _init(tx, params), tx.init(params)
        assert jax.tree_util.tree_structure(mine) == jax.tree_util.tree_structure(theirs)
        for a, b in zip(jax.tree_util.tree_leaves(mine), jax.tree_util.tree_leaves(theirs)):
            assert a.dtype == b.dtype and a.shape == b.shape and (np.asarray(a) == np.asarray(b)).all()
    # an init that computes on the host (cannot be traced) runs as it is
    host = optax.GradientTransformation(lambda p: {"scale": float(np.asarray(p["b"]).sum())},
                                        lambda u, s, p=None: (u, s))
    assert _init(host, params) == {"scale": 3.0}

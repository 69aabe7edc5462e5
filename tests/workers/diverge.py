"""Test worker: the MLP trainer, but process 1 corrupts its params after step 2's commit.

The consistency guard (check every 5 steps) must then stop every member with a
ConsistencyError naming process 1.
"""

import numpy as np

import jaxft

rt = jaxft.initialize()

import jax
import optax

from jaxft.bench.mlp import init_params, loss_fn, make_dataset


def corrupt(trainer, record):
    if record.step == 2 and rt.process_id == 1:
        p = dict(trainer.state.params)
        p["b3"] = np.asarray(p["b3"]) + np.float32(1e-6)
        trainer.state.params = p


dataset = make_dataset(512)
params = jax.tree_util.tree_map(np.asarray, init_params(0, 16, 8))
trainer = jaxft.ElasticTrainer(loss_fn, optax.sgd(0.01), params, jaxft.GlobalBatches(dataset, 24),
                               runtime=rt, on_commit=corrupt,
                               options=jaxft.LoopOptions(check_every=5))
try:
    trainer.run(10)
except jaxft.ConsistencyError as e:
    rt.events.log("consistency_error", step=e.step, processes=e.processes)
    raise

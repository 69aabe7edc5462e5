"""Test worker: two ``ElasticTrainer.run`` calls in one job (train to 4, then on to 8), with
process 1 slow between them; or ``--min_members 2`` (a run that must not train alone)."""

import argparse
import time

import jaxft

parser = argparse.ArgumentParser()
parser.add_argument("--min_members", type=int, default=1)
parser.add_argument("--steps", type=int, default=8)
args, _ = parser.parse_known_args()
rt = jaxft.initialize()

import numpy as np
import optax

rng = np.random.default_rng(0)
data = {"x": rng.normal(size=(64, 4)).astype(np.float32), "y": rng.normal(size=(64,)).astype(np.float32)}


def loss_fn(p, b):
    return (b["x"] @ p["w"] - b["y"]) ** 2


trainer = jaxft.ElasticTrainer(loss_fn, optax.sgd(0.05), {"w": np.zeros(4, np.float32)},
                               jaxft.GlobalBatches(data, 8, seed=0), runtime=rt,
                               options=jaxft.LoopOptions(retry=jaxft.RetryPolicy(min_members=args.min_members)),
                               on_commit=lambda t, r: time.sleep(0.2) if args.min_members > 1 else None)
if args.min_members == 1:
    trainer.run(4)
    if rt.process_id == 1:
        time.sleep(2.0)  # the other waits at the first barrier of the second run, well past 0.5 s
trainer.run(args.steps)

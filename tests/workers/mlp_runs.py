"""Test worker: the MLP of ``jaxft.bench.mlp`` trained by one or more ``run()`` calls, with a
data source that can fail on purpose.

  --runs 20,80             run(20), then run(80) (a continuation), in one program
  --fail_batch P:K[:N]     process P's data source raises at step K, the first N times (1)
  --pipeline / --commit_every N / --step_sleep S / --reduction R / --checkpoint_every C
  --no_gc                  Python's automatic garbage collection off: what reference cycles
                           hold is freed only by jaxft's own collections
"""

import argparse
import gc
import os
import time

import jaxft

parser = argparse.ArgumentParser()
parser.add_argument("--runs", default="20")
parser.add_argument("--fail_batch", default="")
parser.add_argument("--pipeline", action="store_true")
parser.add_argument("--commit_every", type=int, default=1)
parser.add_argument("--step_sleep", type=float, default=0.0)
parser.add_argument("--reduction", default="allreduce")
parser.add_argument("--checkpoint_every", type=int, default=0)
parser.add_argument("--no_gc", action="store_true")
args, _ = parser.parse_known_args()
if args.no_gc:
    gc.disable()
rt = jaxft.initialize()

import jax
import numpy as np
import optax

from jaxft.bench.mlp import init_params, loss_fn, make_dataset


class FlakyBatches(jaxft.GlobalBatches):
    """GlobalBatches whose ``batch(step)`` raises on one process at one step, a few times."""

    def __init__(self, *a, fail: str = "", **k):
        super().__init__(*a, **k)
        self.fail = tuple(int(x) for x in fail.split(":")) if fail else None
        self.raised = 0

    def batch(self, step):
        if self.fail is not None:
            process, at, times = (self.fail + (1,))[:3]
            if rt.process_id == process and step == at and self.raised < times:
                self.raised += 1
                raise OSError(f"the data source of process {process} could not read step {step} (on purpose)")
        return super().batch(step)


params = jax.tree_util.tree_map(np.array, init_params(0, 16, 32))
data = FlakyBatches(make_dataset(1024), 96, seed=0, fail=args.fail_batch)
ckpt = None
if args.checkpoint_every:
    ckpt = jaxft.ElasticCheckpointer(os.path.join(os.environ["JAXFT_RUN_DIR"], "checkpoints"),
                                     runtime=rt, data=data,
                                     options=jaxft.CheckpointOptions(every=args.checkpoint_every))


def on_commit(trainer, record):
    if ckpt is not None:
        ckpt.on_commit(trainer, record)
    if args.step_sleep:
        time.sleep(args.step_sleep)


trainer = jaxft.ElasticTrainer(loss_fn, optax.adam(1e-2), params, data, runtime=rt, on_commit=on_commit,
                               reduction=jaxft.Reduction(args.reduction,
                                                         chunks=8 if args.reduction != "allreduce" else None),
                               options=jaxft.LoopOptions(pipeline=args.pipeline, commit_every=args.commit_every))
if ckpt is not None:
    ckpt.restore(trainer)
for target in (int(x) for x in args.runs.split(",")):
    state = trainer.run(target)
    print(f"run({target}) returned at step {state.step}", flush=True)
if ckpt is not None:
    ckpt.close()

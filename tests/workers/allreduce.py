"""Test worker: initialize jaxft, then all-reduce over the live processes for a while.

Each round is one :class:`jaxft.ElasticGroup` step. Logs ``allreduce`` (members, value)
per committed round and ``round_failed`` when a peer died or restarted mid-round.
Exits 0 after ``--seconds``.
"""

import argparse
import time

import jaxft

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=15.0)
args, _ = parser.parse_known_args()  # extra words: markers tests put on the command line

rt = jaxft.initialize()

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

group = jaxft.ElasticGroup()
rt.events.log("worker_start", devices=len(jax.devices()))
deadline = time.time() + args.seconds
rounds = 0
stop = False
while not stop:
    try:
        with group.step() as m:
            # Each member contributes (process_id + 1, wants_to_stop); the stop decision
            # is the all-reduced flag, so every member stops after the same round.
            local = [d for d in m.devices if d.process_index == rt.process_id]
            row = np.array([[rt.process_id + 1.0, float(time.time() > deadline)]], np.float32)
            x = jax.make_array_from_single_device_arrays(
                (m.size, 2), NamedSharding(m.mesh, P("data")), [jax.device_put(row, d) for d in local])
            sums = jax.jit(lambda a: a.sum(axis=0), out_shardings=NamedSharding(m.mesh, P()))(x)
            total, stops = (float(v) for v in np.asarray(jax.block_until_ready(sums).addressable_data(0)))
    except jaxft.StepFailed as e:
        rt.events.log("round_failed", failed=list(e.failed))
        continue
    rounds += 1
    rt.events.log("allreduce", members=list(m.process_ids), value=total, round=rounds,
                  generation=m.generation, reset=m.reset)
    stop = stops > 0
    time.sleep(0.1)
group.finish()
rt.events.log("worker_done", rounds=rounds)

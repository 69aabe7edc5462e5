"""Test worker: a multi-process CPU executable serialized by process 0 runs in process 1.

What jaxft.worker.executables relies on to share step programs between a run's processes:
process 0 compiles an all-reduce over every device and writes it (``_compat.serialize_compiled``)
to argv[1]; process 1 loads those bytes (``_compat.load_compiled``) instead of compiling, and
both run it. Each process logs a ``program_share`` event with the sum it got. Run by
tests/test_private_api.py under ``jaxft launch -n 2``.
"""

import os
import pickle
import sys
import time

import jaxft

rt = jaxft.initialize()

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxft import _compat

path = sys.argv[1]
devices = sorted(jax.devices(), key=lambda d: d.id)
mesh = Mesh(np.array(devices), ("x",))
step = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P(),
                             check_vma=False))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                           np.arange(4, dtype=np.float32)[None] + jax.process_index())
if jax.process_index() == 0:
    compiled = step.lower(x).compile()
    with open(path + ".tmp", "wb") as f:
        pickle.dump(_compat.serialize_compiled(compiled), f)
    os.replace(path + ".tmp", path)
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(path, "rb") as f:
        compiled = _compat.load_compiled(pickle.load(f), devices)
total = np.asarray(compiled(x).addressable_data(0)).ravel().tolist()
rt.events.log("program_share", total=total)

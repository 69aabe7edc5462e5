"""Test worker: a multi-process CPU executable compiled (and cached) by process 0 in one run
is loaded from the persistent cache by every process of the next run, and so is a program
on each process's own device (cached by that process).

Run twice by tests/test_private_api.py under ``jaxft launch -n 2`` with the same cache
directory (argv[1]); each process logs a ``cache`` event with how many persistent-cache
hits jax reported (``jax.monitoring``) for each and the results of the computations.
Process 0 compiles the step only once process 1 has: otherwise process 1, when it is the
slower one to start, finds in the first run the entry process 0 has just written (a flaky
``step_hits == 1``, seen once on Python 3.12 in CI).
"""

import sys

import jaxft
from jaxft.worker import kv

rt = jaxft.initialize(options=jaxft.InitOptions(compilation_cache=sys.argv[1]))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)

devices = sorted(jax.devices(), key=lambda d: d.id)
mesh = Mesh(devices, ("x",))
local = [d for d in devices if d.process_index == jax.process_index()]
rows = [jax.device_put(np.full((4,), d.id + 1.0, np.float32), d) for d in local]
x = jax.make_array_from_single_device_arrays((4 * len(devices),), NamedSharding(mesh, P("x")), rows)
step = jax.jit(lambda v: jnp.sum(jnp.tanh(v) * 3.0 + v), out_shardings=NamedSharding(mesh, P()))
lowered = step.lower(x)
client, key = kv.client(), "test/cache_share/compiled-by-1"
before = len(hits)
if jax.process_index() == 0:  # process 1 compiles first: in the first run it never finds the
    client.blocking_key_value_get(key, 60_000)  # entry process 0 writes as it compiles (a race)
compiled = lowered.compile()
step_hits = len(hits) - before
if jax.process_index() == 1:
    client.key_value_set(key, "1")
out = float(np.asarray(compiled(x).addressable_data(0)))
mine = jax.device_put(np.arange(6.0, dtype=np.float32), local[0])  # a program on this process's device only
own = float(jax.jit(lambda v: jnp.sum(jnp.cos(v) * 5.0 - v))(mine))
rt.events.log("cache", step_hits=step_hits, value=out, own_hits=len(hits) - before - step_hits, own_value=own)

"""jaxft.worker.warmup: the step compiled ahead for a member set one failure away is the program
the retry runs (no compile left for it), and the background worker's rules."""

import threading
import time

from helpers import PYTHON, clean_env, run

from jaxft.worker import warmup

# One process with 4 CPU devices: ahead-of-time compile the step for 3 of them the way the
# loop's warm-up does, then build the arguments as try_step does and count jax's compile log
# lines for the call; a mesh never warmed (2 devices) is the control.
CHECK = r'''
import logging, sys, types
import jax, numpy as np, optax
from jax.sharding import Mesh
import jaxft
from jaxft.bench.mlp import init_params, loss_fn, make_dataset
from jaxft.core import votes as votes_lib
from jaxft.worker.arrays import replicate
from jaxft.worker.programs import votes_array

compiles = []
class Count(logging.Handler):
    def emit(self, record):
        if "compil" in record.getMessage().lower():
            compiles.append(record.getMessage()[:80])
logging.getLogger("jax").addHandler(Count())
logging.getLogger("jax").setLevel(logging.DEBUG)
jax.config.update("jax_log_compiles", True)

data = jaxft.GlobalBatches(make_dataset(512), 96, seed=0)
params = jax.tree_util.tree_map(np.asarray, init_params(0, 16, 32))
admission = sys.argv[1]
loop = jaxft.ElasticTrainer(loss_fn, optax.adam(1e-2), params, data,
                            options=jaxft.LoopOptions(precompile=8, admission=admission)).loop
for warm, width in ((True, 3), (False, 2)):
    mesh = Mesh(np.array(jax.devices()[:width]), ("data",))
    batch, mask = loop.executor.feeder.place(0, mesh)
    if warm:
        shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), loop.state)
        loop.executor.programs.compile_for(mesh, shapes, loop.executor.feeder.template)
    compiles.clear()
    args = (replicate(loop.state, mesh), batch, mask)
    if admission == "ready":
        args += (votes_array(votes_lib.empty(1), mesh, "data"),)
    programs = loop.executor.programs
    jax.block_until_ready(programs.call(mesh, programs.for_mesh(mesh), args))  # as try_step calls it
    print("warm" if warm else "cold", len(compiles))
'''


def test_a_step_compiled_ahead_is_not_compiled_again():
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    for admission in ("connect", "ready"):
        r = run([PYTHON, "-c", CHECK, admission], env=env, timeout=240)
        assert r.returncode == 0, r.describe()
        counts = dict(line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["warm"], ["cold"]))
        assert counts["cold"] != "0", r.describe()  # the log does show compiles
        assert counts["warm"] == "0", (admission, r.describe())


# The rejoin's agreement compiled ahead (Precompiler, for each swap and the rejoin) is the program
# the agreement then loads from jax's persistent cache, after the in-memory caches are gone (as
# after a backend rebuild); a mesh never compiled ahead (2 devices) is the control.
AGREE = r'''
import sys
import jax, numpy as np
from jax.sharding import Mesh
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from jaxft.worker import rejoin, transfer

counts = {"requests": 0, "hits": 0}
def listen(name, **kwargs):
    if name == "/jax/compilation_cache/compile_requests_use_cache":
        counts["requests"] += 1
    elif name == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
jax.monitoring.register_event_listener(listen)

row = rejoin._agree_row(7, 2, rejoin.Signature.of({"w": np.zeros(3)}))
for warm, width in ((True, 3), (False, 2)):
    mesh = Mesh(np.array(jax.devices()[:width]), ("data",))
    if warm:
        rejoin.compile_agree(mesh)
    jax.clear_caches()
    before = dict(counts)
    rows = transfer.allgather_rows(row, mesh)
    assert rows.shape == (width, 4) and (rows == row.astype(rows.dtype)).all(), rows  # (int32 without x64)
    print("warm" if warm else "cold", counts["requests"] - before["requests"] - (counts["hits"] - before["hits"]))
'''


def test_the_agreement_compiled_ahead_is_loaded_not_compiled(tmp_path):
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = run([PYTHON, "-c", AGREE, str(tmp_path / "cache")], env=env, timeout=240)
    assert r.returncode == 0, r.describe()
    misses = dict(line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["warm"], ["cold"]))
    assert misses == {"warm": "0", "cold": "1"}, r.describe()


def test_shrinks_are_the_sets_one_failure_away():
    # then a death and its successor (gloo's ring may leave the successor aborted or stuck)
    assert warmup.shrinks([0, 1, 2, 3]) == [(0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3),
                                            (1, 2), (0, 1), (0, 3), (2, 3)]
    assert warmup.shrinks([0, 1, 2]) == [(0, 1), (0, 2), (1, 2), (1,), (0,), (2,)]
    assert warmup.shrinks([0, 1, 2, 3], min_members=3) == [(0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3)]
    assert warmup.shrinks([2, 0]) == [(0,), (2,)]
    assert warmup.shrinks([0]) == []
    assert warmup.shrinks([0, 1, 2], min_members=3) == []  # below min_members no step commits


def test_a_rebuild_waits_for_the_job_in_progress_and_drops_the_queued_ones():
    w = warmup.Warmer()
    started, release, ran = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        release.wait(5)
        ran.append("slow")

    w.submit("a", slow)
    w.submit("b", lambda: ran.append("b"))
    w.submit("a", lambda: ran.append("a again"))  # queued already: ignored
    assert started.wait(5)
    paused_at = []

    def rebuild():
        w.pause()
        paused_at.append(list(ran))
        w.resume()

    t = threading.Thread(target=rebuild)
    t.start()
    time.sleep(0.1)
    assert paused_at == []  # still waiting for the compile in progress
    release.set()
    t.join(5)
    assert paused_at == [["slow"]]
    w.submit("c", lambda: ran.append("c"))
    deadline = time.monotonic() + 5
    while "c" not in ran and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == ["slow", "c"]  # "b" was for the old backend

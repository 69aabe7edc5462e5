"""jaxft.worker.warmup: the step compiled ahead for a member set one failure away is the program
the retry runs (no compile left for it), what is compiled ahead by default, and the background
worker's rules."""

import threading
import time

from helpers import CACHE_ENV, MLP, PYTHON, by_event, clean_env, launch, run, train

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


# Two processes under jaxft launch (its persistent cache): process 0 compiles ahead, the way its
# warm-up does, the gloo rendezvous and the agreement of both processes' devices; then both drop
# the in-memory caches (as a backend rebuild does) and run them: every process loads process 0's
# programs instead of compiling its own (a key that differed from process to process, or from
# what the way back lowers, would miss). A program of each process's own, never compiled, is the
# control.
AHEAD = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
import jaxft
rt = jaxft.initialize()
from jaxft.worker import kv, rejoin, rendezvous, transfer

misses = [0]
def listen(name, **kwargs):
    if name == "/jax/compilation_cache/compile_requests_use_cache":
        misses[0] += 1
    elif name == "/jax/compilation_cache/cache_hits":
        misses[0] -= 1
jax.monitoring.register_event_listener(listen)
devices = sorted(jax.devices(), key=lambda d: d.id)
mesh = Mesh(np.array(devices), ("data",))
if rt.process_id == 0:
    rendezvous.compile_for(devices)  # (compiled, not run)
    rejoin.compile_agree(mesh)
kv.client().wait_at_barrier("ahead", 60000)
jax.clear_caches()
row = rejoin._agree_row(7, 2, rejoin.Signature.of({"w": np.zeros(3)}))
for name, run in (("rendezvous", lambda: rendezvous.compile_for(devices)()),
                  ("agree", lambda: transfer.allgather_rows(row, mesh)),
                  ("control", lambda: jax.jit(jnp.sin)(np.ones(3, np.float32)))):  # (each its own)
    before = misses[0]
    out = run()
    print("AHEAD", name, misses[0] - before, flush=True)
    if name == "agree":  # (bit for bit: int64 rows without jax_enable_x64)
        assert out.dtype == np.int64 and (out == row).all(), out
'''


def test_the_way_back_compiled_ahead_by_process_0_is_loaded_by_every_process(tmp_path):
    # (the run's own cache, empty: not the session's, where earlier tests may have left them)
    r = launch(2, [PYTHON, "-c", AHEAD], run_dir=tmp_path, timeout=120, env=clean_env(**{CACHE_ENV: ""}))
    assert r.returncode == 0, r.describe()
    seen = sorted(line.split()[-2:] for line in r.stdout.splitlines() if "AHEAD" in line)
    assert seen == sorted([name, "0" if name != "control" else "1"]
                          for name in ("rendezvous", "agree", "control") for _ in range(2)), r.describe()


def test_by_default_process_0_compiles_ahead_one_step_one_death_away_on_cpu(tmp_path):
    # Without precompile, the first death of a run compiled the narrower step while the survivors
    # waited (~1.4 s here); on CPU one program serves every set of its width (reassigned), so
    # process 0 compiles one: the set less the highest member, and no other step; not at the
    # narrower width after process 2's death either (the survivors train on at width 2).
    r, evts = train(tmp_path, MLP, "--steps", "80", "--step_sleep", "0.05", n=3,
                    faults=["kill:process=2:step=50:phase=before-step"])
    assert by_event(evts, "commit", step=79, members=[0, 1]), r.describe()
    steps = [e["members"] for e in by_event(evts, "precompiled", program="step")]
    assert steps == [[0, 1]], (steps, r.describe())
    assert all(e["process"] == 0 for e in by_event(evts, "precompiled")), r.describe()


def test_shrinks_are_the_sets_one_failure_away():
    # then a death and its successor (gloo's ring may leave the successor aborted or stuck)
    assert warmup.shrinks([0, 1, 2, 3]) == [(0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3),
                                            (1, 2), (0, 1), (0, 3), (2, 3)]
    assert warmup.shrinks([0, 1, 2]) == [(0, 1), (0, 2), (1, 2), (1,), (0,), (2,)]
    assert warmup.shrinks([0, 1, 2, 3], min_members=3) == [(0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3)]
    assert warmup.shrinks([2, 0]) == [(0,), (2,)]
    assert warmup.shrinks([0]) == []
    assert warmup.shrinks([0, 1, 2], min_members=3) == []  # below min_members no step commits


def busy_warmer() -> tuple[warmup.Warmer, threading.Event, list[str]]:
    """A warm-up thread inside a job ("slow", which ends once ``release`` is set) with job "b"
    queued behind it; ``ran`` lists the jobs that ended, in order."""
    w = warmup.Warmer()
    started, release, ran = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        release.wait(5)
        ran.append("slow")

    w.submit("a", slow)
    w.submit("b", lambda: ran.append("b"))
    assert started.wait(5)
    return w, release, ran


def test_a_rebuild_waits_for_the_job_in_progress_and_drops_the_queued_ones():
    w, release, ran = busy_warmer()
    w.submit("a", lambda: ran.append("a again"))  # queued already: ignored
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


def test_at_exit_the_job_in_progress_ends_and_no_other_starts():
    # (A daemon thread still inside XLA's compiler as the interpreter ended aborted the process
    # after its run: "terminate called after throwing an instance of ''".)
    w, release, ran = busy_warmer()
    closer = threading.Thread(target=w.close)
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive()  # waits for the job in progress
    release.set()
    closer.join(5)
    assert not closer.is_alive() and ran == ["slow"]
    w.submit("c", lambda: ran.append("c"))
    time.sleep(0.2)
    assert ran == ["slow"]

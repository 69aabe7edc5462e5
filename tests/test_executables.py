"""jaxft.worker.executables: a step program outlives a backend rebuild (no tracing, no compile after
it, same bits), a run's processes share the programs they compile only with a process of
the same code, and a waiter's bounds. Real processes; one process with 4 CPU devices stands
for the members (the rebuild is jax's own clear_backends)."""

import os
import socket
import threading
import time

import pytest
from helpers import PYTHON, clean_env, new_function, run

from jaxft.worker import executables

# argv: shared directory, "first" mesh width, "then" mesh width, loss variant[, "ref": name the
# shared programs by the loop's reference program, as ElasticLoop does].
# Prints the number of jax compile/trace log lines of each phase and the programs' counters.
SCRIPT = r'''
import hashlib, logging, sys, types
import jax, numpy as np, optax
import jax.extend.backend as jax_backend
from jax.sharding import Mesh
import jaxft
from jaxft.worker import executables
from jaxft.bench import mlp
from jaxft.core import votes as votes_lib
from jaxft.worker.arrays import replicate
from jaxft.worker.programs import votes_array

directory, first, then, variant = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
logs = []
class Count(logging.Handler):
    def emit(self, record):
        m = record.getMessage().lower()
        if "compiling" in m or "tracing" in m:
            logs.append(m[:60])
logging.getLogger("jax").addHandler(Count())
logging.getLogger("jax").setLevel(logging.DEBUG)
jax.config.update("jax_log_compiles", True)

loss = mlp.loss_fn if variant == "same" else (lambda p, b: 2.0 * mlp.loss_fn(p, b))
data = jaxft.GlobalBatches(mlp.make_dataset(512), 96, seed=0)
params = jax.tree_util.tree_map(np.asarray, mlp.init_params(0, 16, 32))
loop = jaxft.ElasticTrainer(loss, optax.adam(1e-2), params, data).loop  # (ready admission)
reference = loop.executor.programs.reference if sys.argv[5:] == ["ref"] else None
programs = loop.executor.programs
programs.executables = executables.Executables(directory if directory != "-" else None, reference=reference)

def step(width):
    mesh = Mesh(np.array(jax.devices()[:width]), ("data",))
    batch, mask = loop.executor.feeder.place(0, mesh)
    args = (replicate(loop.state, mesh), batch, mask, votes_array(votes_lib.empty(1), mesh, "data"))
    logs.clear()
    out = loop.executor.programs.call(mesh, loop.executor.programs.for_mesh(mesh), args)
    digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(out[0]))).hexdigest()
    return len(logs), digest[:16]

n, a = step(first)
print("first", n, a)
n, b = step(then)
print("then", n, b)
jax_backend.clear_backends()  # what a rejoin does on CPU
loop.executor.programs.reset()
n, c = step(then)
print("rebuilt", n, c, c == b)
print("counters", loop.executor.programs.executables.loads, loop.executor.programs.executables.compiles)
'''


def _run(*argv, **env_vars):
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4", **env_vars)
    r = run([PYTHON, "-c", SCRIPT, *map(str, argv)], env=env, timeout=240)
    assert r.returncode == 0, r.describe()
    return {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()
            if line.split()[:1] in (["first"], ["then"], ["rebuilt"], ["counters"])}


def test_a_program_outlives_a_backend_rebuild():
    got = _run("-", 4, 3, "same")
    assert got["then"][0] != "0", got  # the log shows tracing and compiling when there is work
    assert got["rebuilt"][0] == "0", got  # after the rebuild: loaded, neither traced nor compiled
    assert got["rebuilt"][2] == "True", got  # bit for bit what the compiled program gave before
    assert got["counters"] == ["1", "2"], got


def test_programs_loaded_from_the_persistent_cache_are_not_kept(tmp_path):
    # Serialized again, a CPU program jax loaded from its persistent cache loses its kernels
    # ("NOT_FOUND: Function ..._fusion not found" when run): only fresh compiles are kept.
    cache = dict(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    cold = _run("-", 4, 3, "same", **cache)
    assert cold["counters"] == ["1", "2"], cold
    warm = _run("-", 4, 3, "same", **cache)  # every compile is a cache hit now
    assert warm["rebuilt"][2] == "True", warm  # it ran after the rebuild, with the same bits
    assert warm["counters"] == ["0", "3"], warm  # nothing kept: compiled (from the cache) again
    assert warm["then"][1] == cold["then"][1], (warm, cold)


def test_programs_are_shared_only_between_processes_of_the_same_code(tmp_path):
    shared = tmp_path / "programs"
    first = _run(shared, 4, 3, "same")  # compiles widths 4 and 3, writes both (loads 3 after the rebuild)
    assert first["counters"] == ["1", "2"], first
    assert len([p for p in os.listdir(shared) if p.endswith(".pkl")]) == 2
    again = _run(shared, 4, 3, "same")  # same code: its first program gives the fingerprint, the rest loads
    # widths 4 and 3 from the files (4 once traced for the fingerprint), 3 from memory after the rebuild
    assert again["counters"] == ["3", "0"], again
    assert again["then"][1] == first["then"][1], (again, first)
    other = _run(shared, 4, 3, "other")  # another loss: another fingerprint, nothing of the first loaded
    assert other["counters"] == ["1", "2"], other


def test_a_process_whose_first_mesh_differs_reads_the_shared_programs(tmp_path):
    # A joiner's first program is for the mesh it joins: named by its own first program it
    # could read none of the others' (it compiled them again); named by the reference program
    # (the step on every device) it loads them.
    shared = tmp_path / "programs"
    writer = _run(shared, 4, 3, "same", "ref")
    assert writer["counters"] == ["1", "2"], writer
    joiner = _run(shared, 3, 4, "same", "ref")  # widths 3 and 4 from the files, 4 from memory after the rebuild
    assert joiner["counters"] == ["3", "0"], joiner
    assert joiner["first"][1] == writer["then"][1] and joiner["then"][1] == writer["first"][1], (joiner, writer)


@pytest.mark.soak  # time budget; the loop always names its programs by the reference (above)
def test_without_a_reference_a_process_whose_first_mesh_differs_shares_nothing(tmp_path):
    unnamed = _run(tmp_path / "other", 4, 3, "same")
    assert unnamed["counters"] == ["1", "2"], unnamed
    first_program = _run(tmp_path / "other", 3, 4, "same")  # named by its own first program: nothing shared
    assert first_program["counters"] == ["1", "2"], first_program


def test_a_waiter_gives_up_without_a_compiler_and_waits_for_one(tmp_path):
    store = executables.Executables(str(tmp_path), appear_s=0.3, wait_s=5.0)
    store._fingerprint = "f" * 16
    key = ((0, 1), ("sig",))
    t0 = time.monotonic()
    assert store._await_shared(key) is None  # nobody compiles it: back after appear_s
    assert 0.3 <= time.monotonic() - t0 < 2.0
    marker = store._path(key) + ".compiling"
    with open(marker, "w") as f:
        f.write(f"{socket.gethostname()} 999999999")  # a compiler that is gone
    t0 = time.monotonic()
    assert store._await_shared(key) is None
    assert time.monotonic() - t0 < 1.0
    with open(marker, "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}")  # a live one that ends without a file
    threading.Timer(0.5, os.unlink, [marker]).start()
    t0 = time.monotonic()
    assert store._await_shared(key) is None
    assert 0.4 <= time.monotonic() - t0 < 2.0


# One program per width: a thread compiles the step for devices (0, 1, 2) (the warm-up) while
# the main thread needs it for (1, 2, 3) (a retry), then for (0, 1, 3). Then each set's program
# compiled on its own (a second store that does not reassign) for the bits. Prints each output's
# devices and digest, and the counters.
PER_WIDTH = r"""
import hashlib, threading, time, types
import jax, numpy as np, optax
from jax.sharding import Mesh
import jaxft
from jaxft.worker import executables
from jaxft.bench import mlp
from jaxft.core import votes as votes_lib
from jaxft.worker.arrays import replicate
from jaxft.worker.programs import votes_array

PRINT = threading.Lock()  # two threads print: one line each, never interleaved
data = jaxft.GlobalBatches(mlp.make_dataset(512), 96, seed=0)
params = jax.tree_util.tree_map(np.asarray, mlp.init_params(0, 16, 32))
loop = jaxft.ElasticTrainer(mlp.loss_fn, optax.adam(1e-2), params, data).loop  # (ready admission)

def step(mode, ids):
    mesh = Mesh(np.array([jax.devices()[i] for i in ids]), ("data",))
    batch, mask = loop.executor.feeder.place(0, mesh)
    args = (replicate(loop.state, mesh), batch, mask, votes_array(votes_lib.empty(1), mesh, "data"))
    out = loop.executor.programs.call(mesh, loop.executor.programs.for_mesh(mesh), args)
    devices = sorted({s.device.id for x in jax.tree_util.tree_leaves(out[0]) for s in x.addressable_shards})
    digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(out[0]))).hexdigest()
    with PRINT:
        print(mode, ids, "on", devices, digest[:16], flush=True)

for mode in ("reassign", "compile"):
    store = loop.executor.programs.executables = executables.Executables(None)
    store.reassign = mode == "reassign"
    loop.executor.programs._compiled.clear()
    warm = threading.Thread(target=step, args=(mode, (0, 1, 2)))
    warm.start()
    while not store._compiling and warm.is_alive():
        time.sleep(0.001)
    step(mode, (1, 2, 3))
    warm.join()
    step(mode, (0, 1, 3))
    print(mode, "counters", store.compiles, store.reassigned)
"""


def test_one_program_per_width_serves_every_device_set_of_that_width():
    r = run([PYTHON, "-c", PER_WIDTH], env=clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4"),
            timeout=240)
    assert r.returncode == 0, r.describe()
    got = {mode: sorted(line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith(mode + " ("))
           for mode in ("reassign", "compile")}
    # each set's program ran on that set's devices, with the bits of its own compile
    assert got["reassign"] == got["compile"] and len(got["reassign"]) == 3, (got, r.describe())
    for ids in ("0, 1, 2", "1, 2, 3", "0, 1, 3"):
        assert any(line.startswith(f"({ids}) on [{ids}] ") for line in got["reassign"]), (ids, got)
    assert "compile counters 3 0" in r.stdout, r.describe()
    assert "reassign counters 1 2" in r.stdout, r.describe()  # the retry waited for the warm-up's compile


def test_processes_name_a_shared_program_alike_whatever_the_addresses_in_its_arguments(tmp_path):
    # A flax TrainState's functions (static data) print their addresses, which differ from
    # process to process: the name under which one process wrote a program must be the one
    # another process reads it by (else each compiled its own, after waiting for the file).
    import jax
    import numpy as np

    def args(fn):
        return ({"fn": jax.tree_util.Partial(fn), "w": np.zeros(3, np.float32)},)

    ex = executables.Executables(str(tmp_path), reference=lambda: "the reference program")
    ex.name_shared()
    fa, fb = new_function(), new_function()  # (both alive: two addresses)
    a, b = executables.key((0, 1), args(fa)), executables.key((0, 1), args(fb))
    assert a != b  # (in one process: other static data, another program)
    ex._write(a, executables.Program((b"bytes",), (0, 1), None))
    assert ex._read(b) is not None
    assert ex._read(executables.key((0, 2), args(new_function()))) is None  # another mesh: another program
    # A program's bytes carry its arguments' tree structure: a local function's does not pickle
    # (a TrainState's optax closures), so nobody waits for its file, which cannot be written.
    assert not ex._can_share(a, args(fa))
    assert ex._can_share(executables.key((0, 1), args(np.tanh)), args(np.tanh))


def test_a_compile_marker_whose_pid_was_reused_names_a_compile_that_is_gone(tmp_path):
    # A compile killed in an earlier run leaves its marker in a cache directory shared across
    # runs ($JAXFT_COMPILATION_CACHE); once its pid belongs to a process started after the
    # marker was written, nobody waits for it.
    from jaxft.worker import compile_marks, lives

    program = str(tmp_path / "step.pkl")
    marker = compile_marks.claim(program)
    assert marker is not None and compile_marks.claim(program) is None  # one claim at a time
    owner = compile_marks.owner(program)
    assert owner == f"{socket.gethostname()} {os.getpid()}"
    assert not compile_marks.gone(owner, program)  # a live process, which wrote it now: compiling
    started = lives.started_at(os.getpid())
    assert started is not None and started <= time.time()
    os.utime(marker, (started - 60, started - 60))  # written a minute before that process started
    assert compile_marks.gone(owner, program)
    assert compile_marks.gone(f"{socket.gethostname()} 999999999", program)  # no such process
    assert not compile_marks.gone(f"another-host {os.getpid()}", program)  # not known here


def test_a_program_loaded_ahead_waits_for_its_file_and_gives_up_when_stale(tmp_path):
    # (jaxft.worker.warmup's members and spares load ahead what process 0 compiles for a swap.)
    store = executables.Executables(str(tmp_path))
    store._fingerprint = "f" * 16
    key = ((0, 1), ("sig",))
    path = store._path(key)
    store._load = lambda k, program=None: "program" if os.path.exists(store._path(k)) else None  # (its bytes)
    threading.Timer(0.3, lambda: open(path, "w").close()).start()  # process 0's compile lands
    t0 = time.monotonic()
    assert store.preload(key, stale=lambda: time.monotonic() - t0 > 5, poll_s=0.02)
    assert 0.25 <= time.monotonic() - t0 < 2 and store._loaded[key] == "program" and store.preloaded == 1
    other = ((1, 2), ("sig",))
    t0 = time.monotonic()
    assert not store.preload(other, stale=lambda: time.monotonic() - t0 > 0.2, poll_s=0.02)  # never compiles
    assert other not in store._loaded
    threading.Timer(0.1, store.reset).start()  # a rebuild meanwhile: what it would load is for the old backend
    t0 = time.monotonic()
    assert not store.preload(other, stale=lambda: time.monotonic() - t0 > 5, poll_s=0.02)
    assert time.monotonic() - t0 < 1 and other not in store._loaded

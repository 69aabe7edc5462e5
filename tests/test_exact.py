"""The chunked reductions: a step's result is bitwise independent of the number of devices
(``exact``: guaranteed; ``allreduce64``: in practice).

One process with 4 CPU devices (``--xla_force_host_platform_device_count``, in a child
process so the flag applies); the same params and batches stepped on meshes of 1..4
devices, with chunk counts that give 1, 2 and more chunks per device and padding chunks.
"""

import pytest
from helpers import PYTHON, clean_env, run

CHECK = r'''
import hashlib, os, sys
import jax, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxft
from jaxft.bench.mlp import init_params, loss_fn, make_dataset
from jaxft.worker.data import shard_batch
from jaxft.worker.train_step import make_train_step

G, STEPS = 96, 2
data = jaxft.GlobalBatches(make_dataset(1024), G, seed=0)

def run(width, reduction, chunks):
    mesh = Mesh(np.array(jax.devices()[:width]), ("data",))
    rep = NamedSharding(mesh, P())
    opt = optax.adam(1e-2)
    params = jax.device_put(init_params(0, 16, 32), rep)
    opt_state = jax.device_put(opt.init(params), rep)
    step = make_train_step(loss_fn, opt, G, mesh, jaxft.Reduction(reduction, chunks=chunks))
    chunk = G // chunks if chunks else None
    for s in range(STEPS):
        batch, mask = shard_batch(data.batch(s), mesh, chunk=chunk)
        params, opt_state, loss = step(params, opt_state, batch, mask)
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves((params, loss))]
    return hashlib.sha256(b"".join(x.tobytes() for x in leaves)).hexdigest()

for chunks in map(int, sys.argv[1:]):
    print(f"exact:{chunks}", *(run(w, "exact", chunks) for w in (1, 2, 3, 4)))
print("allreduce64:8", *(run(w, "allreduce64", 8) for w in (1, 2, 3, 4)))
print("allreduce", *(run(w, "allreduce", None) for w in (1, 2, 3, 4)))
'''


@pytest.mark.smoke
def test_exact_reduction_is_bitwise_width_independent():
    # chunks 1: one chunk, devices 2-4 hold padding; 3: widths 3 and 4 run one chunk per
    # device (the loop XLA would drop); 8: 8, 4, 3 (+1 padding chunk), 2 chunks per device.
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = run([PYTHON, "-c", CHECK, "1", "3", "8"], env=env, timeout=240)
    assert r.returncode == 0, r.describe()
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines() if line.strip()}
    for chunks in ("1", "3", "8"):
        shas = rows[f"exact:{chunks}"]
        assert len(shas) == 4 and len(set(shas)) == 1, (chunks, shas)
    # the float64 all-reduce of the same chunks: the same bits here too (not guaranteed: a sum
    # within ~2^-53 of a float32 rounding boundary could round either way); 8 chunks only (time
    # budget: the chunk layouts are the exact reduction's, checked above for 1 and 3)
    wide = rows["allreduce64:8"]
    assert len(wide) == 4 and len(set(wide)) == 1, wide
    # the default all-reduce is not width-independent: what the exact reduction is for
    assert len(set(rows["allreduce"])) > 1, rows["allreduce"]


def test_exact_reduction_arguments_are_checked():
    import optax

    import jaxft
    from jaxft.bench.mlp import init_params, loss_fn, make_dataset

    data = jaxft.GlobalBatches(make_dataset(64), 96)
    params = init_params(0, 16, 8)
    for kwargs, words in [({"kind": "exact"}, "needs chunks"),
                          ({"kind": "exact", "chunks": 7}, "dividing"),
                          ({"kind": "exact", "chunks": 0}, "chunks must be >= 1"),
                          ({"kind": "exact", "chunks": 8, "micro_batch": 4}, "micro_batch=None"),
                          ({"chunks": 8}, "chunks is for"),
                          ({"kind": "allreduce64"}, "needs chunks"),
                          ({"kind": "allreduce64", "chunks": 5}, "dividing"),
                          ({"kind": "psum"}, "reduction must be")]:
        with pytest.raises(ValueError, match=words):
            jaxft.ElasticTrainer(loss_fn, optax.sgd(0.1), params, data, reduction=jaxft.Reduction(**kwargs))


def test_chunked_layout_keeps_the_chunk_size_whatever_the_width():
    from jaxft.worker.data import Layout

    for width in range(1, 11):
        lay = Layout.chunked(96, width, 12)  # 8 chunks of 12
        assert lay.micro_size == 12 and lay.num_micro == -(-8 // width)
        # chunk j is micro-batch j % k of device j // k
        for j in range(8):
            d, i = divmod(j, lay.num_micro)
            assert list(lay.positions(d)[i * 12:(i + 1) * 12]) == list(range(12 * j, 12 * j + 12))


@pytest.mark.soak  # the default suite covers it: test_elastic's kills end with the fault-free sha
def test_kill_and_narrower_run_end_bitwise_equal(tmp_path):
    """Real processes: process 1 SIGKILLed at step 8 (its step retried on 2 processes, then it
    rejoins), a fault-free run on 3 and one on 2 all end with the same params_sha256."""
    from helpers import MLP, by_event, finals, train

    # connect admission: the restart rejoins within the run (ready admission's rejoin takes
    # longer than these 16 steps after the kill; test_admission.py checks its bits)
    worker = (MLP, "--steps", "24", "--step_sleep", "0.3", "--reduction", "exact", "--exact_chunks", "8",
              "--admission", "connect")
    # the restart connects 5 s after the kill (a standby has its imports done): after the members'
    # failed step 8 (here the heartbeat's, 3 s: connect admission) and their retry on 2
    proc, ev = train(tmp_path / "kill", *worker, faults=["kill:process=1:step=8"], restart="on-failure",
                     extra=["--restart-delay", "5"])
    assert proc.returncode == 0, proc.describe()
    assert by_event(ev, "step_failed", process=0), "the kill must have failed a step"
    assert any(len(e["members"]) == 2 for e in by_event(ev, "commit", process=0)), "no step ran on 2"
    shas = {}
    for name, n in (("kill", 3), ("clean3", 3), ("clean2", 2)):
        if name != "kill":
            proc, ev = train(tmp_path / name, *worker, n=n)
            assert proc.returncode == 0, proc.describe()
        f = finals(ev)
        assert sorted(e["process"] for e in f) == list(range(n)) and {e["step"] for e in f} == {24}, f
        shas[name] = {e["params_sha256"] for e in f}
    assert len(set.union(*shas.values())) == 1, shas


def test_the_bench_cli_lists_the_trainer_reductions():
    # jaxft.bench names them without importing jax; a new reduction must reach its --reduction
    from jaxft import bench
    from jaxft.worker import options

    assert bench.REDUCTIONS == options.REDUCTIONS


def test_the_chaos_bench_hands_its_reduction_to_the_mlp_runs():
    # `jaxft bench chaos --reduction R` runs all three mlp runs with R (chunked ones in CHUNKS chunks)
    import argparse

    from jaxft import bench
    from jaxft.bench.chaos import reduction_flags
    from jaxft.bench.overhead import CHUNKS

    assert reduction_flags("allreduce") == ["--reduction", "allreduce"]
    for r in ("allreduce64", "exact"):
        assert reduction_flags(r) == ["--reduction", r, "--exact_chunks", str(CHUNKS)]
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="cmd"))
    assert parser.parse_args(["bench", "chaos", "--reduction", "allreduce64"]).reduction == "allreduce64"
    assert parser.parse_args(["bench", "chaos"]).reduction == "allreduce"

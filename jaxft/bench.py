"""``jaxft bench``: figures, never assertions.

* ``jaxft bench overhead -n 2``: per-step time of the atomic elastic step next to a plain
  multi-process JAX loop with the same model, batch and mesh.
* ``jaxft bench rehydrate --mb 100``: time to send a state of that size from a donor to a
  joiner over the live devices, next to a plain TCP loopback copy of the same bytes.

Each starts its own ``jaxft launch`` job; the workers are this module's ``worker``
entry points.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from jaxft.events import read_events
from jaxft.report import first_commits, recovery_times


def _launch(n: int, args: list[str], run_dir: str) -> None:
    cmd = [sys.executable, "-m", "jaxft.cli", "launch", "-n", str(n), "--run-dir", run_dir, "--",
           sys.executable, "-m", "jaxft.bench", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark job failed:\n{(proc.stdout + proc.stderr)[-4000:]}")


def _result(run_dir: str, name: str) -> dict:
    found = [e for e in read_events(run_dir) if e["event"] == name and e["process"] == 0]
    if not found:
        raise SystemExit(f"benchmark produced no {name} event")
    return found[-1]


# -- overhead -------------------------------------------------------------------------
def _overhead_worker(steps: int, hidden: int, batch: int) -> None:
    import jaxft

    rt = jaxft.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxft.data import shard_batch
    from jaxft.trainer import _replicate, make_train_step

    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(batch * 4, hidden)).astype(np.float32),
            "y": rng.normal(size=(batch * 4, 1)).astype(np.float32)}
    params = {"w1": (rng.normal(size=(hidden, hidden)) / np.sqrt(hidden)).astype(np.float32),
              "w2": (rng.normal(size=(hidden, hidden)) / np.sqrt(hidden)).astype(np.float32),
              "w3": (rng.normal(size=(hidden, 1)) / np.sqrt(hidden)).astype(np.float32)}

    def loss_fn(p, b):
        h = jnp.tanh(jnp.tanh(b["x"] @ p["w1"]) @ p["w2"])
        return jnp.sum((h @ p["w3"] - b["y"]) ** 2, axis=-1)

    tx = optax.sgd(1e-3)
    batches = jaxft.GlobalBatches(data, batch, seed=0)
    trainer = jaxft.ElasticTrainer(loss_fn, tx, params, batches, runtime=rt)
    for _ in range(3):  # warm up: first step rebuilds the data plane and compiles
        trainer.try_step()
    t_elastic = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.try_step()
        t_elastic.append(time.perf_counter() - t0)

    # The plain loop: same step function, fixed mesh, state kept as global arrays.
    mesh = trainer.group.mesh(sorted(jax.devices(), key=lambda d: d.id))
    fn = make_train_step(loss_fn, tx, batch, mesh)
    p = _replicate(params, mesh)
    o = _replicate(tx.init(params), mesh)
    t_plain = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        b, m = shard_batch(batches.batch(i), mesh)
        p, o, loss = fn(p, o, b, m)
        jax.block_until_ready(loss)
        if i >= 3:
            t_plain.append(time.perf_counter() - t0)
    del NamedSharding, P
    el, pl = statistics.median(t_elastic), statistics.median(t_plain)
    rt.events.log("bench_overhead", elastic_ms=round(el * 1e3, 3), plain_ms=round(pl * 1e3, 3),
                  ratio=round(el / pl, 4), steps=steps, processes=rt.num_processes, hidden=hidden,
                  global_batch=batch)
    trainer.group.finish()


def bench_overhead(n: int = 2, steps: int = 100, hidden: int = 512, batch: int = 512) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        _launch(n, ["worker-overhead", str(steps), str(hidden), str(batch)], run_dir)
        r = _result(run_dir, "bench_overhead")
    return {k: r[k] for k in ("elastic_ms", "plain_ms", "ratio", "steps", "processes", "hidden", "global_batch")}


# -- rehydration ------------------------------------------------------------------------
def _socket_copy_s(nbytes: int) -> float:
    """Seconds to push ``nbytes`` through a loopback TCP connection (send + receive)."""
    payload = os.urandom(1 << 20) * max(1, nbytes >> 20)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send():
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(payload)

    t0 = time.perf_counter()
    thread = threading.Thread(target=send)
    thread.start()
    conn, _ = server.accept()
    buf = bytearray(len(payload))
    view, got = memoryview(buf), 0
    while got < len(payload):
        k = conn.recv_into(view[got:], min(1 << 22, len(payload) - got))
        if not k:
            break
        got += k
    thread.join()
    elapsed = time.perf_counter() - t0
    conn.close()
    server.close()
    return elapsed


def _rehydrate_worker(mb: float) -> None:
    import jaxft

    rt = jaxft.initialize()
    import numpy as np

    from jaxft import transfer

    n = int(mb * (1 << 20)) // 4
    tree = {"params": np.arange(n // 2, dtype=np.float32), "opt": np.arange(n - n // 2, dtype=np.int32)}
    if rt.process_id != 0:
        tree = {k: np.zeros_like(v) for k, v in tree.items()}
    group = jaxft.ElasticGroup()
    with group.step() as m:  # fresh processes: first step rebuilds the data plane
        pass
    times = []
    for _ in range(3):
        with group.step() as m:
            t0 = time.perf_counter()
            got = transfer.broadcast_tree(tree, 0, m.mesh)
            times.append(time.perf_counter() - t0)
    ok = all(np.array_equal(got[k], np.asarray(v) if rt.process_id == 0 else got[k]) for k, v in tree.items())
    ok = ok and bool(got["params"][-1] == np.float32(n // 2 - 1))
    nbytes = transfer.tree_nbytes(tree)
    sock = statistics.median(_socket_copy_s(nbytes) for _ in range(3)) if rt.process_id == 0 else 0.0
    t = statistics.median(times)
    rt.events.log("bench_rehydrate", bytes=nbytes, seconds=round(t, 4), mb_per_s=round(nbytes / t / 1e6, 1),
                  socket_seconds=round(sock, 4), socket_mb_per_s=round(nbytes / sock / 1e6, 1) if sock else None,
                  ratio=round(t / sock, 2) if sock else None, correct=ok, processes=rt.num_processes)
    group.finish()


def bench_rehydrate(n: int = 2, mb: float = 100) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        _launch(n, ["worker-rehydrate", str(mb)], run_dir)
        r = _result(run_dir, "bench_rehydrate")
    return {k: r[k] for k in ("bytes", "seconds", "mb_per_s", "socket_seconds", "socket_mb_per_s", "ratio",
                              "correct", "processes")}


# -- chaos --------------------------------------------------------------------------------
def _mlp() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(os.path.dirname(here), "examples", "mlp.py")
    if not os.path.exists(path):
        raise SystemExit(f"jaxft bench chaos needs the repository's examples/mlp.py (looked in {path})")
    return path


def run_figures(events: list[dict], steps: int) -> dict:
    """Training time, steps lost and recovery times of one run, from its events."""
    first = first_commits(events)
    counts: dict[tuple[int, int], int] = {}
    for e in events:
        if e["event"] == "commit":
            counts[(e["process"], e["step"])] = counts.get((e["process"], e["step"]), 0) + 1
    if sorted(first) != list(range(steps)):
        raise SystemExit(f"run did not commit steps 0..{steps - 1}")
    per_process: dict[int, int] = {}
    for (p, _), c in counts.items():
        per_process[p] = per_process.get(p, 0) + c - 1
    _, recoveries = recovery_times(events)
    train_s = first[steps - 1] - first[0]
    return {"train_s": round(train_s, 3), "steps_per_s": round((steps - 1) / train_s, 3),
            "steps_lost": max(per_process.values(), default=0),
            "recovery_s": round(statistics.mean(recoveries), 3) if recoveries else None,
            "faults": len(recoveries)}


def bench_chaos(n: int = 4, steps: int = 150, kill_every: float = 10.0, checkpoint_every: int = 20,
                step_sleep: float = 0.1, seed: int = 0, keep_dirs: str | None = None,
                overhead: bool = True) -> dict:
    """The same training three ways: fault-free, jaxft with kills, restart-all with kills."""
    import random

    base = keep_dirs or tempfile.mkdtemp(prefix="jaxft-chaos-")
    worker = [_mlp(), "--steps", str(steps), "--step_sleep", str(step_sleep),
              "--checkpoint_every", str(checkpoint_every), "--check_every", "0"]

    def job(name: str, restart: str, faults: list[str]) -> list[dict]:
        run_dir = os.path.join(base, name)
        cmd = [sys.executable, "-m", "jaxft.cli", "launch", "-n", str(n), "--run-dir", run_dir,
               "--restart", restart, "--max-restarts", "50"]
        for f in faults:
            cmd += ["--fault", f]
        proc = subprocess.run(cmd + ["--", sys.executable, *worker], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"chaos run {name} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        return read_events(run_dir)

    ff_events = job("fault_free", "on-failure", [])
    start = min(e["time"] for e in ff_events)
    first_commit = min(e["time"] for e in ff_events if e["event"] == "commit") - start
    last_commit = max(e["time"] for e in ff_events if e["event"] == "commit") - start
    rng = random.Random(seed)
    times = []
    t = first_commit + kill_every
    while t < last_commit:
        times.append(t)
        t += kill_every
    schedule = [f"kill:process={rng.randrange(n)}:after={t:.2f}s" for t in times]
    figures = {"fault_free": run_figures(ff_events, steps)}
    figures["jaxft"] = run_figures(job("jaxft", "on-failure", schedule), steps)
    figures["restart_all"] = run_figures(job("restart_all", "all", schedule), steps)
    ff = figures["fault_free"]["train_s"]
    for name in figures:
        figures[name]["goodput"] = round(ff / figures[name]["train_s"], 3)
    figures["schedule"] = schedule
    figures["config"] = {"processes": n, "steps": steps, "kill_every_s": kill_every,
                         "checkpoint_every": checkpoint_every, "step_sleep_s": step_sleep, "seed": seed,
                         "run_dirs": base if keep_dirs else None}
    if overhead:
        figures["overhead"] = bench_overhead(n=2)
        figures["overhead_ratio"] = figures["overhead"]["ratio"]
    if not keep_dirs:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return figures


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print figures")
    which = p.add_subparsers(dest="bench", required=True)
    o = which.add_parser("overhead", help="atomic elastic step vs a plain multi-process loop")
    o.add_argument("-n", type=int, default=2)
    o.add_argument("--steps", type=int, default=100)
    o.add_argument("--hidden", type=int, default=512)
    o.add_argument("--global-batch", type=int, default=512)
    r = which.add_parser("rehydrate", help="state transfer to a joiner vs a TCP loopback copy")
    r.add_argument("-n", type=int, default=2)
    r.add_argument("--mb", type=float, default=100)
    c = which.add_parser("chaos", help="goodput under failures: jaxft vs restart-all-from-checkpoint")
    c.add_argument("-n", type=int, default=4)
    c.add_argument("--steps", type=int, default=150)
    c.add_argument("--kill-every", type=float, default=10.0, help="seconds between kills")
    c.add_argument("--checkpoint-every", type=int, default=20)
    c.add_argument("--step-sleep", type=float, default=0.1, help="stretch each step by this many seconds")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--keep-dirs", default=None, help="keep the three run directories under this path")
    c.add_argument("--no-overhead", action="store_true", help="skip the per-step overhead measurement")
    for q in (o, r, c):
        q.add_argument("--json", default=None, help="also write the figures to this file")


def run(args) -> int:
    if args.bench == "overhead":
        figures = bench_overhead(args.n, args.steps, args.hidden, args.global_batch)
        print(f"per step: elastic {figures['elastic_ms']:.2f} ms, plain {figures['plain_ms']:.2f} ms, "
              f"ratio {figures['ratio']:.3f} ({figures['processes']} processes)")
    elif args.bench == "chaos":
        figures = bench_chaos(args.n, args.steps, args.kill_every, args.checkpoint_every, args.step_sleep,
                              args.seed, args.keep_dirs, overhead=not args.no_overhead)
        print(f"{'':12s} {'goodput':>8s} {'steps lost':>10s} {'recovery s':>10s} {'train s':>8s}")
        for name in ("fault_free", "jaxft", "restart_all"):
            f = figures[name]
            print(f"{name:12s} {f['goodput']:8.3f} {f['steps_lost']:10d} {str(f['recovery_s']):>10s} "
                  f"{f['train_s']:8.1f}")
        print(f"{len(figures['schedule'])} kills, one every {args.kill_every:g} s; "
              f"checkpoint every {args.checkpoint_every} steps")
        if "overhead_ratio" in figures:
            o = figures["overhead"]
            print(f"per-step overhead of jaxft over a plain JAX loop: {o['ratio']:.3f} "
                  f"({o['elastic_ms']:.2f} vs {o['plain_ms']:.2f} ms)")
    else:
        figures = bench_rehydrate(args.n, args.mb)
        print(f"rehydrate {figures['bytes'] / 1e6:.1f} MB: {figures['seconds']:.3f} s "
              f"({figures['mb_per_s']} MB/s); TCP loopback {figures['socket_seconds']:.3f} s "
              f"({figures['socket_mb_per_s']} MB/s); ratio {figures['ratio']} (correct: {figures['correct']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    kind, *rest = sys.argv[1:]
    if kind == "worker-overhead":
        _overhead_worker(int(rest[0]), int(rest[1]), int(rest[2]))
    elif kind == "worker-rehydrate":
        _rehydrate_worker(float(rest[0]))
    else:
        raise SystemExit(f"unknown worker {kind!r}")

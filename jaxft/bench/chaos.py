"""``jaxft bench chaos``: the same training fault-free, with jaxft under a kill schedule, and
with restart-everything-from-checkpoint (``jaxft launch --restart all``) under the same
schedule. The workload is :mod:`jaxft.bench.mlp`, shipped in the package, so the benchmark
runs from an installed jaxft."""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from jaxft.bench.overhead import CHUNKS, bench_overhead
from jaxft.errors import ConfigError
from jaxft.events import read_events
from jaxft.protocol import Event
from jaxft.supervisor.report import first_commits, recovery_times
from jaxft.worker.options import valid_commit_every


def reduction_flags(reduction: str) -> list[str]:
    """:mod:`jaxft.bench.mlp`'s flags for ``reduction`` (the chunked ones in :data:`CHUNKS` chunks)."""
    return ["--reduction", reduction] + (["--exact_chunks", str(CHUNKS)] if reduction != "allreduce" else [])


def final_params(run_dir: str) -> dict[str, np.ndarray]:
    """The lowest finishing process's final params, as ``jaxft.bench.mlp --final_params RUN_DIR/final``
    wrote them (with hot spares, process 0's last life may have waited out the run as a spare)."""
    d = os.path.join(run_dir, "final")
    names = sorted((f for f in os.listdir(d) if f.startswith("final-p") and f.endswith(".npz")),
                   key=lambda f: int(f[len("final-p"):-len(".npz")]))
    if not names:
        raise FileNotFoundError(f"no final-p*.npz in {d}")
    with np.load(os.path.join(d, names[0])) as z:
        return {k: z[k] for k in z.files}


def params_diff(params: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> dict:
    """``params`` against ``reference`` leaf by leaf: bitwise equal, and the largest relative
    difference ``|a - b| / |b|`` (norms over each leaf) of any leaf."""
    rel = [float(np.linalg.norm(params[k] - v) / max(float(np.linalg.norm(v)), 1e-30)) for k, v in reference.items()]
    return {"bitwise_equal": all(np.array_equal(params[k], v) for k, v in reference.items()),
            "max_rel_diff_per_leaf": max(rel, default=0.0)}


def run_figures(events: list[dict], steps: int) -> dict:
    """Training time, steps lost and recovery times of one run, from its events."""
    first = first_commits(events)
    counts: dict[tuple[int, int], int] = {}
    for e in events:
        if e["event"] == Event.COMMIT:
            counts[(e["process"], e["step"])] = counts.get((e["process"], e["step"]), 0) + 1
    if sorted(first) != list(range(steps)):
        raise SystemExit(f"run did not commit steps 0..{steps - 1}")
    per_process: dict[int, int] = {}
    for (p, _), c in counts.items():
        per_process[p] = per_process.get(p, 0) + c - 1
    _, recoveries = recovery_times(events)
    train_s = first[steps - 1] - first[0]
    times = [first[s] for s in range(steps)]
    widths = [len(e["members"]) for e in events if e["event"] == Event.COMMIT]
    finals = {e["params_sha256"] for e in events if e["event"] == Event.FINAL}
    return {"train_s": round(train_s, 3), "steps_per_s": round((steps - 1) / train_s, 3),
            "steps_lost": max(per_process.values(), default=0),
            "recovery_s": round(statistics.mean(recoveries), 3) if recoveries else None,
            "faults": len(recoveries),
            # the longest gap between consecutive new committed steps, and the fewest members
            # on a committed step (below n: the survivors trained on while a process came back)
            "max_stall_s": round(max((b - a for a, b in zip(times, times[1:])), default=0.0), 3),
            "min_width": min(widths, default=0),
            "finals_agree": len(finals) == 1}  # every process that finished holds the same params


@dataclasses.dataclass(frozen=True)
class Workload:
    """What every run trains (:mod:`jaxft.bench.mlp`): ``steps`` steps of ``step_sleep`` s each, a
    checkpoint every ``checkpoint_every`` (a multiple of ``commit_every`` unless it is ``"auto"``), the gradient
    ``reduction`` (the chunked ones in :data:`CHUNKS` chunks), ``pipeline`` and ``commit_every``
    (:class:`~jaxft.LoopOptions`)."""

    steps: int = 300
    step_sleep: float = 0.1
    checkpoint_every: int = 20
    reduction: str = "allreduce"
    pipeline: bool = False
    commit_every: int | str = "auto"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When the kills fall: every ``kill_every`` seconds of the fault-free run's training time,
    or (None) ``kills`` of them spread evenly over it; the process killed drawn with ``seed``."""

    kill_every: float | None = None
    kills: int = 5
    seed: int = 0


def bench_chaos(n: int = 4, workload: Workload = Workload(), schedule: Schedule = Schedule(), *,
                admission: str = "ready", precompile: int = 8, keep_dirs: str | None = None,
                overhead: bool = True, spares: int = 0) -> dict:
    """The same training three ways: fault-free, jaxft with kills, restart-all with kills (and a
    fourth, ``jaxft_spares``, with ``spares`` hot spares and the same kills, when > 0).

    The jaxft run uses ``admission`` (``ready``: survivors train on while a restarted process
    sets up) and ``precompile`` (:mod:`jaxft.worker.warmup`); so does the fault-free run, the
    reference of every goodput. The restart-all run has no use for either. Each faulty run's
    final params are compared with the fault-free run's leaf by leaf (``params_vs_fault_free``).
    ``keep_dirs``: where the run dirs go (kept); ``overhead``: also run ``jaxft bench overhead``.
    """
    import random

    steps, step_sleep, checkpoint_every = workload.steps, workload.step_sleep, workload.checkpoint_every
    reduction, pipeline, commit_every = workload.reduction, workload.pipeline, workload.commit_every
    kill_every, kills, seed = schedule.kill_every, schedule.kills, schedule.seed
    if not valid_commit_every(commit_every) or (commit_every != "auto" and checkpoint_every % int(commit_every)):
        raise ConfigError(f"--commit-every {commit_every}: must be auto, or >= 1 and divide --checkpoint-every "
                         f"{checkpoint_every} (on_commit runs once per commit)")

    base = keep_dirs or tempfile.mkdtemp(prefix="jaxft-chaos-")
    worker = ["-m", "jaxft.bench.mlp", "--steps", str(steps), "--step_sleep", str(step_sleep),
              "--checkpoint_every", str(checkpoint_every), "--check_every", "0", *reduction_flags(reduction),
              *(["--pipeline"] if pipeline else []), "--commit_every", str(commit_every)]
    params: dict[str, dict[str, np.ndarray]] = {}

    def job(name: str, restart: str, faults: list[str], extra: tuple[str, ...] = (), spares: int = 0) -> list[dict]:
        run_dir = os.path.join(base, name)
        extra = (*extra, "--final_params", os.path.join(run_dir, "final"))
        cmd = [sys.executable, "-m", "jaxft.cli", "launch", "-n", str(n), "--run-dir", run_dir,
               "--restart", restart, "--max-restarts", "50", "--spares", str(spares)]
        for f in faults:
            cmd += ["--fault", f]
        proc = subprocess.run(cmd + ["--", sys.executable, *worker, *extra], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"chaos run {name} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        params[name] = final_params(run_dir)
        return read_events(run_dir)

    elastic = ("--admission", admission, "--precompile", str(precompile))
    ff_events = job("fault_free", "on-failure", [], elastic)
    start = min(e["time"] for e in ff_events)
    first_commit = min(e["time"] for e in ff_events if e["event"] == Event.COMMIT) - start
    last_commit = max(e["time"] for e in ff_events if e["event"] == Event.COMMIT) - start
    rng = random.Random(seed)
    times = []
    if kill_every:
        t = first_commit + kill_every
        while t < last_commit:
            times.append(t)
            t += kill_every
    else:  # spread evenly, the last one well before the end (the run gets slower under kills)
        span = (last_commit - first_commit) * 0.8
        times = [first_commit + span * (i + 1) / (kills + 1) for i in range(kills)]
    rules = [f"kill:process={rng.randrange(n)}:after={t:.2f}s" for t in times]
    figures: dict[str, Any] = {"fault_free": run_figures(ff_events, steps)}  # (also the schedule, the config)
    figures["jaxft"] = run_figures(job("jaxft", "on-failure", rules, elastic), steps)
    figures["restart_all"] = run_figures(job("restart_all", "all", rules), steps)
    if spares:  # (the kills name processes 0..n-1: members, or spares by then)
        figures["jaxft_spares"] = run_figures(job("jaxft_spares", "on-failure", rules, elastic, spares), steps)
    ff = figures["fault_free"]["train_s"]
    for name in figures:
        figures[name]["goodput"] = round(ff / figures[name]["train_s"], 3)
        if name != "fault_free":
            figures[name]["params_vs_fault_free"] = params_diff(params[name], params["fault_free"])
    figures["schedule"] = rules
    figures["config"] = {"processes": n, "steps": steps, "kill_every_s": kill_every, "kills": len(rules),
                         "admission": admission, "precompile": precompile, "reduction": reduction, "pipeline": pipeline,
                         "commit_every": commit_every, "spares": spares,
                         "checkpoint_every": checkpoint_every, "step_sleep_s": step_sleep, "seed": seed,
                         "run_dirs": base if keep_dirs else None}
    if overhead:
        figures["overhead"] = bench_overhead(n=2, pipeline=pipeline, commit_every=commit_every)
        figures["overhead_ratio"] = figures["overhead"]["ratio"]
    if not keep_dirs:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return figures



"""``jaxft bench kill``: how long a SIGKILL stalls the survivors, and what a rejoin costs them.

One run of the mlp workload under ``jaxft launch --restart on-failure``: ``kills`` faults at a
fixed phase, ``every`` steps apart, alternating between processes 1 and 2 (a process is
killed again only after it rejoined). For each kill it reports the time from the fault to
the survivors' next commit (the step they retry, or the next one), and for each rejoin the
time from the restarted process's ``initialize()`` to its first commit and the survivors'
largest gap between new commits meanwhile. Phases: ``before-step`` is a kill between steps
(the survivors meet it in the step's liveness query), ``in-step`` a kill inside the step
(the survivors are in its all-reduce).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile

from jaxft.events import read_events
from jaxft.protocol import Event


def kill_figures(events: list[dict]) -> dict:
    """Per kill and per rejoin figures from a run's events (each victim from its ``fault`` event)."""
    commits = sorted((e["time"], e["step"], e["process"]) for e in events if e["event"] == Event.COMMIT)
    first_commit: dict[int, float] = {}
    for t, step, _ in commits:
        first_commit.setdefault(step, t)
    new_commits = sorted(first_commit.values())
    faults = sorted((e["time"], e["step"], e["process"]) for e in events if e["event"] == Event.FAULT)
    stalls = []
    for t, _step, victim in faults:
        after = [c for c, s, p in commits if c > t and p != victim]
        if after:
            stalls.append(round(after[0] - t, 3))
    rejoins = []
    for e in events:
        if e["event"] != Event.INITIALIZED or e.get("incarnation", 0) == 0:
            continue
        p, inc, t0 = e["process"], e["incarnation"], e["time"]
        mine = sorted(c["time"] for c in events if c["event"] == Event.COMMIT and c["process"] == p
                      and c.get("incarnation", 0) == inc)
        if not mine:
            continue
        gaps = [b - a for a, b in zip(new_commits, new_commits[1:]) if a >= t0 and b <= mine[0]]
        rejoins.append({"process": p, "init_to_first_commit_s": round(mine[0] - t0, 3),
                        "survivors_max_gap_s": round(max(gaps), 3) if gaps else None})
    return {"kill_to_next_commit_s": stalls,
            "median_kill_to_next_commit_s": statistics.median(stalls) if stalls else None,
            "rejoins": rejoins,
            "median_init_to_first_commit_s": _median([r["init_to_first_commit_s"] for r in rejoins]),
            "median_survivors_max_gap_s": _median([r["survivors_max_gap_s"] for r in rejoins
                                                   if r["survivors_max_gap_s"] is not None])}


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def bench_kill(n: int = 3, phase: str = "in-step", kills: int = 5, every: int = 100, step_sleep: float = 0.1,
               heartbeat: int = 3, admission: str = "ready", run_dir: str | None = None) -> dict:
    """Run the job and return :func:`kill_figures` plus the schedule."""
    if n < 3:
        raise ValueError("jaxft bench kill needs -n >= 3 (it kills processes 1 and 2 in turn)")
    run_dir = run_dir or tempfile.mkdtemp(prefix="jaxft-bench-kill-")
    victims = {every * (i + 1): 1 + i % 2 for i in range(kills)}
    steps = every * (kills + 1)
    cmd = [sys.executable, "-m", "jaxft.cli", "launch", "-n", str(n), "--run-dir", run_dir, "--restart",
           "on-failure", "--max-restarts", str(kills), "--heartbeat-timeout", str(heartbeat), "--console", "raw"]
    for step, p in victims.items():
        cmd += ["--fault", f"kill:process={p}:step={step}:phase={phase}"]
    cmd += ["--", sys.executable, "-m", "jaxft.bench.mlp", "--steps", str(steps), "--step_sleep", str(step_sleep),
            "--check_every", "0", "--admission", admission]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark job failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    figures = kill_figures(read_events(run_dir))
    figures.update(processes=n, phase=phase, admission=admission, heartbeat_s=heartbeat,
                   schedule={str(k): v for k, v in victims.items()}, run_dir=os.path.abspath(run_dir))
    return figures

"""Helpers for tests that run real multi-process jobs under ``jaxft launch``."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

from jaxft.events import read_events

REPO = Path(__file__).resolve().parents[1]
MLP = str(REPO / "examples" / "mlp.py")


def launch(run_dir: Path, *worker: str, n: int = 3, faults=(), restart: str = "never",
           extra=(), timeout: float = 240) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``jaxft launch -n N ... -- python WORKER...``; returns the result and the events."""
    cmd = [sys.executable, "-m", "jaxft.cli", "launch", "-n", str(n), "--run-dir", str(run_dir),
           "--restart", restart, *extra]
    for f in faults:
        cmd += ["--fault", f]
    cmd += ["--", sys.executable, *worker]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return proc, read_events(run_dir)


def of(events: list[dict], name: str, **match) -> list[dict]:
    return [e for e in events if e["event"] == name and all(e.get(k) == v for k, v in match.items())]


def finals(events: list[dict]) -> list[dict]:
    return of(events, "final")


def commits_by_step(events: list[dict]) -> dict[int, list[dict]]:
    out = collections.defaultdict(list)
    for e in of(events, "commit"):
        out[e["step"]].append(e)
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def tail(proc: subprocess.CompletedProcess, n: int = 3000) -> str:
    return (proc.stdout + proc.stderr)[-n:]

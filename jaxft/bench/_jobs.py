"""Running a benchmark's workers under ``jaxft launch`` and reading back what they logged."""

from __future__ import annotations

import subprocess
import sys

from jaxft.events import read_events


def launch(n: int, module: str, args: list[str], run_dir: str) -> None:
    """``jaxft launch -n N -- python -m MODULE ARGS``; SystemExit with the output tail if it fails."""
    cmd = [sys.executable, "-m", "jaxft.cli", "launch", "-n", str(n), "--run-dir", run_dir, "--",
           sys.executable, "-m", module, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark job failed:\n{(proc.stdout + proc.stderr)[-4000:]}")


def result(run_dir: str, name: str) -> dict:
    """The last ``name`` event process 0 logged."""
    found = [e for e in read_events(run_dir) if e["event"] == name and e["process"] == 0]
    if not found:
        raise SystemExit(f"benchmark produced no {name} event")
    return found[-1]

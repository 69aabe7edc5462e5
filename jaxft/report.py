"""``jaxft report DIR``: what happened in a run, from ``DIR/events.jsonl``."""

from __future__ import annotations

import json
import os
from typing import Any

from jaxft.events import read_events


def summarize(events: list[dict]) -> dict[str, Any]:
    """Steps, failures survived, rejoins and time lost, from a run's events."""
    commits = [e for e in events if e["event"] == "commit"]
    steps = sorted({e["step"] for e in commits})
    first_commit = {}
    for e in commits:
        first_commit.setdefault(e["step"], e["time"])
    faults = [e for e in events if e["event"] == "fault"]
    kills = [e for e in events if e["event"] == "exit" and e.get("signal") == "SIGKILL"]
    failed_steps = [e for e in events if e["event"] == "step_failed"]
    rehydrated = [e for e in events if e["event"] == "rehydrated"]
    restores = [e for e in events if e["event"] == "restored"]
    # recovery: from each injected fault to the next step committed after it
    recoveries = []
    for f in faults:
        later = [t for t in first_commit.values() if t > f["time"]]
        if later:
            recoveries.append(min(later) - f["time"])
    start = min((e["time"] for e in events if e["event"] in ("run_start", "launch")), default=None)
    end = max((e["time"] for e in events if e["event"] in ("run_end", "final")), default=None)
    widths = {}
    for e in commits:
        widths[e["step"]] = len(e["members"])
    return {
        "steps_committed": len(steps),
        "last_step": steps[-1] if steps else None,
        "faults_injected": len(faults),
        "processes_killed": len(kills),
        "failed_step_attempts": len({e["step"] for e in failed_steps}),
        "rejoins": len(rehydrated),
        "restores": len(restores),
        "mean_recovery_s": round(sum(recoveries) / len(recoveries), 3) if recoveries else None,
        "time_lost_s": round(sum(recoveries), 3),
        "min_width": min(widths.values()) if widths else None,
        "final_width": widths[max(widths)] if widths else None,
        "wall_s": round(end - start, 3) if start and end else None,
        "final_sha256": sorted({e["params_sha256"][:12] for e in events if e["event"] == "final"}),
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"steps committed     {s['steps_committed']} (last step {s['last_step']})",
        f"faults injected     {s['faults_injected']} ({s['processes_killed']} processes SIGKILLed)",
        f"steps retried       {s['failed_step_attempts']}",
        f"rejoins             {s['rejoins']} (rehydrated from a live peer)",
        f"checkpoint restores {s['restores']}",
        f"time lost           {s['time_lost_s']} s (mean recovery {s['mean_recovery_s']} s per fault)",
        f"width               min {s['min_width']}, final {s['final_width']} processes",
        f"wall time           {s['wall_s']} s",
        f"final params        {', '.join(s['final_sha256']) or '-'}"
        + ("  (all processes agree)" if len(s["final_sha256"]) == 1 else ""),
    ]
    return "\n".join(lines)


def main(run_dir: str, as_json: bool = False) -> int:
    if not os.path.exists(os.path.join(run_dir, "events.jsonl")):
        print(f"jaxft report: no events.jsonl in {run_dir}")
        return 2
    s = summarize(read_events(run_dir))
    print(json.dumps(s, indent=2) if as_json else format_summary(s))
    return 0

"""Goodput: where a run's wall time went, from its events (``jaxft report``).

The wall time (launcher ``run_start`` to ``run_end``) is cut at each commit of a step and
every piece goes to exactly one bucket, so the buckets add up to the wall time:

* ``startup``: launch to the first committed step (processes start, connect, compile);
* ``productive``: time between commits that advanced training, at most the typical step
  time when a failure happened in between (less the checkpoint time below);
* ``wasted``: steps computed a second time (after a cold restart from an older checkpoint);
* ``recovery``: the rest of a piece in which a failure happened (detection, retry,
  restart, rejoin), less the restore time;
* ``checkpoint_save``: the step loop's blocking part of each save (``checkpoint_started``);
* ``checkpoint_restore``: reading a checkpoint on a cold restart (``restored``);
* ``shutdown``: the last commit to the end of the run (final checks, evaluation, exit).
"""

from __future__ import annotations

import statistics
from typing import Any

from jaxft.protocol import Event

BUCKETS = ("productive", "wasted", "recovery", "checkpoint_save", "checkpoint_restore", "startup", "shutdown")
TROUBLE = frozenset({Event.FAULT, Event.STEP_FAILED, Event.RESTART, Event.RESTORED, Event.REHYDRATED, Event.EXIT})


def _commit_instants(events: list[dict]) -> list[tuple[float, int]]:
    """(time, step) of each commit of a step by the members together (commits of one step
    less than a second apart are one instant), in time order."""
    by_step: dict[int, list[float]] = {}
    for e in events:
        if e["event"] == Event.COMMIT:
            by_step.setdefault(int(e["step"]), []).append(e["time"])
    out = []
    for step, times in by_step.items():
        times.sort()
        last = None
        for t in times:
            if last is None or t - last > 1.0:
                out.append((t, step))
            last = t
    return sorted(out)


def goodput(events: list[dict]) -> dict[str, Any]:
    """Seconds per bucket, the wall time, and ``goodput`` = productive / wall."""
    starts = [e["time"] for e in events if e["event"] == Event.RUN_START] or [e["time"] for e in events]
    ends = [e["time"] for e in events if e["event"] == Event.RUN_END] or [e["time"] for e in events]
    out: dict[str, Any] = {b: 0.0 for b in BUCKETS}
    if not starts:
        return {**out, "wall_s": 0.0, "goodput": None}
    t_start, t_end = min(starts), max(ends)
    instants = [(t, s) for t, s in _commit_instants(events) if t_start <= t <= t_end]
    wall = t_end - t_start
    if not instants:
        out["startup"] = wall
        return {**out, "wall_s": round(wall, 3), "goodput": 0.0}
    trouble = sorted(e["time"] for e in events if e["event"] in TROUBLE and e.get("reason") != "terminated by launcher"
                     and not (e["event"] == Event.EXIT and e.get("code") == 0))
    pieces = []  # (seconds, new progress?, troubled?)
    best = instants[0][1]
    for (t0, _), (t1, step) in zip(instants, instants[1:]):
        troubled = any(t0 < x <= t1 for x in trouble)
        pieces.append((t1 - t0, step > best, troubled))
        best = max(best, step)
    calm = [d for d, new, bad in pieces if new and not bad]
    typical = statistics.median(calm) if calm else min((d for d, _, _ in pieces), default=0.0)
    for d, new, bad in pieces:
        step_part = min(d, typical) if bad else d
        out["productive" if new else "wasted"] += step_part
        out["recovery"] += d - step_part
    out["startup"] = instants[0][0] - t_start
    out["shutdown"] = t_end - instants[-1][0]
    # Checkpoint time comes out of the buckets it was spent in: saves out of the step time,
    # restores out of the recovery (bounded by what is there).
    saves: dict[int, float] = {}
    for e in events:
        if e["event"] == Event.CHECKPOINT_STARTED and t_start <= e["time"] <= t_end:
            saves[e["step"]] = max(saves.get(e["step"], 0.0), float(e.get("blocking_ms", 0.0)) / 1000)
    save_s = min(sum(saves.values()), out["productive"])
    out["productive"] -= save_s
    out["checkpoint_save"] = save_s
    restores: dict[float, float] = {}  # one cold restart = the restores within a few seconds
    for e in sorted((e for e in events if e["event"] == Event.RESTORED), key=lambda e: e["time"]):
        key = next((k for k in restores if e["time"] - k < 5.0), e["time"])
        restores[key] = max(restores.get(key, 0.0), float(e.get("seconds", 0.0)))
    restore_s = min(sum(restores.values()), out["recovery"] + out["startup"])
    from_recovery = min(restore_s, out["recovery"])
    out["recovery"] -= from_recovery
    out["startup"] -= restore_s - from_recovery
    out["checkpoint_restore"] = restore_s
    out = {k: round(v, 3) for k, v in out.items()}
    out["wall_s"] = round(wall, 3)
    out["goodput"] = round(out["productive"] / wall, 4) if wall > 0 else None
    return out


LABELS = {"productive": "productive steps", "wasted": "wasted (steps redone)", "recovery": "recovery",
          "checkpoint_save": "checkpoint save", "checkpoint_restore": "checkpoint restore",
          "startup": "start-up", "shutdown": "shutdown"}
COLORS = {"productive": "tab:green", "wasted": "tab:orange", "recovery": "tab:red", "checkpoint_save": "tab:blue",
          "checkpoint_restore": "tab:purple", "startup": "tab:gray", "shutdown": "lightgray"}


def format_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """The goodput table of one run, or of several side by side."""
    head = f"{'goodput':<24}" + "".join(f"{name[-22:]:>24}" for name, _ in runs)
    lines = [head]
    for b in BUCKETS:
        cells = "".join(f"{g[b]:>12.2f} s {100 * g[b] / g['wall_s'] if g['wall_s'] else 0:>6.1f} %  "
                        for _, g in runs)
        lines.append(f"  {LABELS[b]:<22}{cells}")
    lines.append(f"  {'sum of buckets':<22}" + "".join(
        f"{sum(g[b] for b in BUCKETS):>12.2f} s {'':>10}" for _, g in runs))
    lines.append(f"  {'wall time':<22}" + "".join(f"{g['wall_s']:>12.2f} s {'':>10}" for _, g in runs))
    lines.append(f"  {'goodput':<22}" + "".join(
        f"{100 * (g['goodput'] or 0):>14.1f} %{'':>8}" for _, g in runs))
    return "\n".join(lines)


def draw(ax, runs: list[tuple[str, dict[str, Any]]]) -> None:
    """A stacked bar per run (seconds per bucket) on ``ax``."""
    for i, (_name, g) in enumerate(runs):
        bottom = 0.0
        for b in BUCKETS:
            ax.bar(i, g[b], bottom=bottom, color=COLORS[b], label=LABELS[b] if i == 0 else None, width=0.6)
            bottom += g[b]
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([name[-18:] for name, _ in runs], fontsize=8)
    ax.set_ylabel("seconds of wall time")
    ax.set_title("goodput (wall time)")
    ax.legend(fontsize=7, loc="upper right")

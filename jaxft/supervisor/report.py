"""``jaxft report DIR``: what happened in a run, from ``DIR/events.jsonl``."""

from __future__ import annotations

import json
import os
from typing import Any

from jaxft.events import read_events
from jaxft.protocol import Event
from jaxft.supervisor import goodput as goodput_lib


def first_commits(events: list[dict]) -> dict[int, float]:
    """Step -> time of its first commit by any process."""
    first: dict[int, float] = {}
    for e in sorted((e for e in events if e["event"] == Event.COMMIT), key=lambda e: e["time"]):
        first.setdefault(e["step"], e["time"])
    return first


def recovery_times(events: list[dict]) -> tuple[list[float], list[float]]:
    """Fault incidents (start times) and, for each, seconds until progress resumed.

    An incident is a burst of faults (a kill-all fires once per process, within a
    second), or a node ``jaxft slurm`` found lost (from when it found it, so its heartbeat
    timeout is not counted); its recovery runs to the first commit of a step not committed
    before it.
    """
    first_commit = first_commits(events)
    faults = [e for e in events if e["event"] in (Event.FAULT, Event.NODE_LOST)]
    incidents: list[float] = []
    for f in sorted(faults, key=lambda e: e["time"]):
        if not incidents or f["time"] - incidents[-1] > 1.0:
            incidents.append(f["time"])
    recoveries = []
    for t_fault in incidents:
        done = max((s for s, t in first_commit.items() if t <= t_fault), default=-1)
        later = [t for s, t in first_commit.items() if s > done and t > t_fault]
        if later:
            recoveries.append(min(later) - t_fault)
    return incidents, recoveries


def summarize(events: list[dict]) -> dict[str, Any]:
    """Steps, failures survived, rejoins and time lost, from a run's events."""
    commits = [e for e in events if e["event"] == Event.COMMIT]
    steps = sorted({e["step"] for e in commits})
    faults = [e for e in events if e["event"] == Event.FAULT]
    kills = [e for e in events if e["event"] == Event.EXIT and e.get("signal") == "SIGKILL"]
    failed_steps = [e for e in events if e["event"] == Event.STEP_FAILED]
    rehydrated = [e for e in events if e["event"] == Event.REHYDRATED]
    # a joiner's start-up restore, superseded by a live peer's state, is not a checkpoint restore
    rejoined = {(e.get("process"), e.get("incarnation")) for e in rehydrated}
    restores = [e for e in events if e["event"] == Event.RESTORED
                and (e.get("process"), e.get("incarnation")) not in rejoined]
    incidents, recoveries = recovery_times(events)
    start = min((e["time"] for e in events if e["event"] in (Event.RUN_START, Event.LAUNCH)), default=None)
    end = max((e["time"] for e in events if e["event"] in (Event.RUN_END, Event.FINAL)), default=None)
    widths = {}
    for e in commits:
        widths[e["step"]] = len(e["members"])
    return {
        "steps_committed": len(steps),
        "last_step": steps[-1] if steps else None,
        "faults_injected": len(faults),
        "incidents": len(incidents),
        "processes_killed": len(kills),
        "failed_step_attempts": len({e["step"] for e in failed_steps}),
        # steps run, then undone on a member because a later step of their commit failed
        # (commit_every): they ran again, as the failed step did
        "steps_undone": len({(e.get("process"), s) for e in events if e["event"] == Event.ROLLED_BACK
                             for s in e.get("steps", ())}),
        "rejoins": len(rehydrated),
        "restores": len(restores),
        "mean_recovery_s": round(sum(recoveries) / len(recoveries), 3) if recoveries else None,
        "time_lost_s": round(sum(recoveries), 3),
        "min_width": min(widths.values()) if widths else None,
        "final_width": widths[max(widths)] if widths else None,
        "wall_s": round(end - start, 3) if start and end else None,
        "final_sha256": sorted({e["params_sha256"][:12] for e in events if e["event"] == Event.FINAL}),
        "goodput": goodput_lib.goodput(events),
        **nodes(events),
    }


def nodes(events: list[dict]) -> dict[str, Any]:
    """What ``jaxft slurm`` did: which node ran which rank, the nodes lost, the new agents, requeues."""
    started = [e for e in events if e["event"] == Event.NODE_STARTED]
    return {
        "nodes": sorted({f"{e['node']} (rank {e['rank']})" for e in started if not e.get("generation")}),
        "nodes_lost": [f"{e['node']} (rank {e['rank']}): {e.get('reason')}" for e in events
                       if e["event"] == Event.NODE_LOST],
        "new_agents": [f"rank {e['rank']} on {e['node']} ({e.get('why')})" for e in started if e.get("generation")],
        "requeues": len([e for e in events if e["event"] == Event.JOB_REQUEUED and not e.get("error")]),
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"steps committed     {s['steps_committed']} (last step {s['last_step']})",
        f"faults injected     {s['faults_injected']} ({s['processes_killed']} processes SIGKILLed)",
        f"steps retried       {s['failed_step_attempts']}"
        + (f" (and {s['steps_undone']} run but undone, by process, before their commit)" if s["steps_undone"] else ""),
        f"rejoins             {s['rejoins']} (rehydrated from a live peer)",
        f"checkpoint restores {s['restores']}",
        f"time lost           {s['time_lost_s']} s over {s['incidents']} incidents "
        f"(mean recovery {s['mean_recovery_s']} s: fault -> next new step committed)",
        f"width               min {s['min_width']}, final {s['final_width']} processes",
        f"wall time           {s['wall_s']} s",
        f"final params        {', '.join(s['final_sha256']) or '-'}"
        + ("  (all processes agree)" if len(s["final_sha256"]) == 1 else ""),
    ]
    if s.get("nodes"):  # a jaxft slurm job
        lines.append(f"nodes               {', '.join(s['nodes'])}")
        lines += [f"node lost           {n}" for n in s["nodes_lost"]]
        lines += [f"new agent           {n}" for n in s["new_agents"]]
        if s["requeues"]:
            lines.append(f"job requeued        {s['requeues']}x (resumed from the newest checkpoint)")
    return "\n".join(lines)


def _name(run_dir: str) -> str:
    return os.path.basename(os.path.abspath(run_dir))


def main(run_dirs: str | list[str], as_json: bool = False, png: str | None = None) -> int:
    """Print the summary and goodput table and write the picture (``RUN_DIR/report.png``
    unless ``png``); with several run directories, compare them side by side."""
    run_dirs = [run_dirs] if isinstance(run_dirs, str) else list(run_dirs)
    for d in run_dirs:
        if not os.path.exists(os.path.join(d, "events.jsonl")):
            print(f"jaxft report: no events.jsonl in {d}")
            return 2
    if len(run_dirs) > 1:
        return compare(run_dirs, as_json, png)
    run_dir = run_dirs[0]
    events = read_events(run_dir)
    if not events:
        print(f"jaxft report: {os.path.join(run_dir, 'events.jsonl')} holds no events")
        return 2
    s = summarize(events)
    png = png or os.path.join(run_dir, "report.png")
    s["report_png"] = plot(events, png, title=f"jaxft run {_name(run_dir)}")
    if as_json:
        print(json.dumps(s, indent=2))
    else:
        print(format_summary(s) + f"\nreport picture      {png}\n"
              + goodput_lib.format_table([(_name(run_dir), s["goodput"])]))
    return 0


def compare(run_dirs: list[str], as_json: bool = False, png: str | None = None) -> int:
    """Several runs side by side: their summaries, goodput tables and one bar chart."""
    runs = [(_name(d), summarize(read_events(d))) for d in run_dirs]
    png = png or os.path.join(run_dirs[0], "compare.png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2.5 + 2 * len(runs), 5), constrained_layout=True)
    goodput_lib.draw(ax, [(n, s["goodput"]) for n, s in runs])
    fig.savefig(png, dpi=110)
    plt.close(fig)
    if as_json:
        print(json.dumps({"runs": dict(runs), "report_png": png}, indent=2))
        return 0
    keys = ["steps_committed", "incidents", "processes_killed", "failed_step_attempts", "rejoins", "restores",
            "time_lost_s", "wall_s"]
    print(f"{'run':<24}" + "".join(f"{n[-22:]:>24}" for n, _ in runs))
    for k in keys:
        print(f"  {k:<22}" + "".join(f"{str(s[k]):>24}" for _, s in runs))
    print(goodput_lib.format_table([(n, s["goodput"]) for n, s in runs]))
    print(f"comparison picture  {png}")
    return 0


def plot(events: list[dict], path: str, title: str | None = None) -> str:
    """Draw the run: process lanes and live width over time, and the loss per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not events:
        raise ValueError("no events to plot")
    t0 = min(e["time"] for e in events)
    t = lambda e: e["time"] - t0  # noqa: E731
    procs = sorted({e["process"] for e in events if isinstance(e.get("process"), int)})
    fig = plt.figure(figsize=(14, 8.5), constrained_layout=True)
    grid = fig.add_gridspec(3, 2, height_ratios=[1.2, 1, 1.4], width_ratios=[4, 1])
    ax_lanes, ax_width, ax_loss = (fig.add_subplot(grid[i, 0]) for i in range(3))
    goodput_lib.draw(fig.add_subplot(grid[:, 1]), [("this run", goodput_lib.goodput(events))])

    # lanes: one row per process, a bar per incarnation (launch -> exit)
    launches = {(e["process"], e["incarnation"]): t(e) for e in events if e["event"] == Event.LAUNCH}
    exits = {(e["process"], e["incarnation"]): e for e in events if e["event"] == Event.EXIT}
    end = max(t(e) for e in events)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (p, inc), start in sorted(launches.items()):
        ex = exits.get((p, inc))
        stop = t(ex) if ex else end
        ax_lanes.barh(p, stop - start, left=start, height=0.6, color=colors[inc % len(colors)], alpha=0.75)
        ax_lanes.text(start + 0.1, p, f"inc {inc}", va="center", fontsize=7, color="white")
        if ex and ex.get("signal"):
            ax_lanes.plot(stop, p, "x", color="red", ms=10, mew=2)
    ax_lanes.set_yticks(procs)
    ax_lanes.set_yticklabels([f"process {p}" for p in procs])
    ax_lanes.invert_yaxis()
    ax_lanes.set_title("worker lifetimes (x = killed)")

    # width: members of each committed step, over time
    commits = sorted((e for e in events if e["event"] == Event.COMMIT), key=lambda e: e["time"])
    first: dict[int, dict] = {}  # step -> its first commit
    for e in commits:
        first.setdefault(e["step"], e)
    pts = sorted(first.values(), key=lambda e: e["time"])
    if pts:
        ax_width.step([t(e) for e in pts], [len(e["members"]) for e in pts], where="post", color="black")
        ax_width.set_ylim(0, max(len(procs), 1) + 0.5)
    for ax in (ax_lanes, ax_width):
        for e in events:
            if e["event"] == Event.FAULT:
                ax.axvline(t(e), color="red", lw=1, alpha=0.6)
            elif e["event"] == Event.REHYDRATED:
                ax.axvline(t(e), color="green", lw=1, ls="--", alpha=0.8)
            elif e["event"] == Event.CHECKPOINT_SAVED:
                ax.axvline(t(e), color="tab:blue", lw=0.8, ls=":", alpha=0.8)
            elif e["event"] == Event.RESTORED:
                ax.axvline(t(e), color="purple", lw=1.2, ls="-.", alpha=0.8)
    ax_width.set_ylabel("live processes")
    ax_width.set_xlabel("seconds since launch")
    ax_width.set_title("live members per committed step (red: fault, green: rejoin, "
                       "blue: checkpoint, purple: restore)")
    ax_lanes.sharex(ax_width)
    ax_width.set_xlim(0, end * 1.01)

    # loss per step, from the first commit of each step
    steps = sorted(first)
    if steps:
        ax_loss.plot(steps, [first[s]["loss"] for s in steps], color="black", lw=1.2)
        ax_loss.set_yscale("log")
    for e in events:
        if e["event"] == Event.STEP_FAILED and e["step"] in first:
            ax_loss.axvline(e["step"], color="red", lw=1, alpha=0.5)
        if e["event"] == Event.REHYDRATED:
            ax_loss.axvline(e["step"], color="green", lw=1, ls="--", alpha=0.7)
        if e["event"] == Event.RESTORED:
            ax_loss.axvline(e["step"], color="purple", lw=1.2, ls="-.", alpha=0.8)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("training loss (red: a step retried after a failure)")
    fig.suptitle(title or "jaxft run")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

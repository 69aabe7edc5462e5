"""Issue 13's acceptance schedule: mlp, 4 processes, 450 steps, --step_sleep 0.1, process 1
SIGKILLed at 12/24/36/48 s and restarted at once, heartbeat 3 s; fault-free vs jaxft (ready
admission) side by side. Prints goodput, time lost per kill, min width, max stall and the
leaf-by-leaf relative difference of the final params from the fault-free run's, and each
restart's way back by phase (``restarts``). ``--victims 1,2,3,0``: issue 40's schedule.
``--spares 1``: the faulty run keeps a hot spare (``jaxft launch --spares``; the fault-free runs
have none), and each death's swap is reported (``swaps``: the death to the first commit with the
spare that took its place).

The fault-free run is repeated after the faulty one (``--fault-free-runs 2``, the default) and
the goodput is taken against the mean of the two: on this 2-core machine the same fault-free
run took anywhere from 55 to 75 s minutes apart, a drift of several seconds per kill.

    .venv/bin/python scripts/recovery_schedule.py [--admission ready|connect] [--steps 450]
        [--reduction allreduce64|exact] [--precompile 8] [--pipeline] [--commit-every N] [--fault-free-runs 1]
        [--victims 1,2,3,0] [--spares 1] [--nice-restarts 19]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from jaxft.bench.chaos import final_params, params_diff, reduction_flags, run_figures
from jaxft.events import read_events
from jaxft.supervisor.report import first_commits


def run(base: str, name: str, steps: int, admission: str, faults: list[str], reduction: str,
        precompile: int = 0, pipeline: bool = False, commit_every: int | str = "auto", early_connect: bool = True,
        spares: int = 0, nice_restarts: int | None = None, standby: bool = True) -> dict:
    run_dir = os.path.join(base, name)
    cmd = [sys.executable, "-m", "jaxft.cli", "launch", "-n", "4", "--run-dir", run_dir, "--restart", "on-failure",
           "--heartbeat-timeout", "3", "--max-restarts", "50", *([] if early_connect else ["--no-early-connect"]),
           "--spares", str(spares), *([] if nice_restarts is None else ["--nice-restarts", str(nice_restarts)]),
           *([] if standby else ["--no-standby"])]
    for f in faults:
        cmd += ["--fault", f]
    cmd += ["--", sys.executable, "-m", "jaxft.bench.mlp", "--steps", str(steps), "--step_sleep", "0.1",
            "--check_every", "0", "--admission", admission, "--final_params", os.path.join(run_dir, "final"),
            "--precompile", str(precompile), *reduction_flags(reduction), *(["--pipeline"] if pipeline else []),
            "--commit_every", str(commit_every)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    evts = read_events(run_dir)
    fig = run_figures(evts, steps)
    # Drift-proof-ish: the seconds the run's new commits came later than its own median step,
    # summed (a fault-free run's figure is this machine's noise).
    first = first_commits(evts)
    gaps = [first[s + 1] - first[s] for s in range(steps - 1)]
    median = statistics.median(gaps)
    fig["stall_excess_s"] = round(sum(max(0.0, g - median) for g in gaps), 3)
    fig["params"] = final_params(run_dir)
    fig["restarts"] = restart_phases(evts)
    if spares:
        fig["swaps"] = spare_swaps(evts)
    return fig


def _first(evts: list[dict], event: str, after: float, **match) -> dict | None:
    """The first ``event`` at or after ``after`` whose fields equal ``match`` (``member=p``: one
    whose ``members`` hold p; ``joiner=p``: whose ``joiners`` do)."""
    for e in evts:
        if e["event"] != event or e["time"] < after:
            continue
        if "member" in match and match["member"] not in e.get("members", ()):
            continue
        if "joiner" in match and match["joiner"] not in e.get("joiners", ()):
            continue
        if all(e.get(k) == v for k, v in match.items() if k not in ("member", "joiner")):
            return e
    return None


def restart_phases(evts: list[dict]) -> list[dict]:
    """Each restart's way back, in seconds after its death (the launcher's ``exit``): started
    (``launch``), connected (``initialized``, of which ``forget_wait_s`` waited for the service
    to forget the dead life), admitted by the members (``admit``), rehydrated, and back (the
    first commit with it)."""
    out = []
    for launch in (e for e in evts if e["event"] == "launch" and e.get("incarnation", 0) > 0):
        p, inc, t = launch["process"], launch["incarnation"], launch["time"]
        death = _first(evts, "exit", 0.0, process=p, incarnation=inc - 1)
        if death is None:
            continue
        init = _first(evts, "initialized", t, process=p, incarnation=inc)
        stages = {"started_s": launch, "connected_s": init,
                  "admitted_s": _first(evts, "admit", t, joiner=p),
                  "rehydrated_s": _first(evts, "rehydrated", t, process=p, incarnation=inc),
                  "back_s": _first(evts, "commit", t, member=p)}
        row = {"process": p, "incarnation": inc, "forget_wait_s": init and init.get("forget_wait_s")}
        row.update({k: None if e is None else round(e["time"] - death["time"], 2) for k, e in stages.items()})
        out.append(row)
    return out


def spare_swaps(evts: list[dict]) -> list[dict]:
    """Each death's swap with spares, in seconds after the death (the launcher's ``exit``): the
    members admitted a spare (``admit``), and the spare's first commit (``back_s``)."""
    out = []
    for death in (e for e in evts if e["event"] == "exit" and e.get("signal")):
        admit = _first(evts, "admit", death["time"])
        back = admit and _first(evts, "commit", admit["time"], member=admit["joiners"][0])
        out.append({"died": death["process"], "spare": admit and admit["joiners"],
                    "before_step": bool(admit and admit.get("before_step")),
                    **{k: None if e is None else round(e["time"] - death["time"], 2)
                       for k, e in (("admitted_s", admit), ("back_s", back))}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--admission", default="ready")
    ap.add_argument("--steps", type=int, default=450)
    ap.add_argument("--reduction", choices=("allreduce", "allreduce64", "exact"), default="allreduce")
    ap.add_argument("--precompile", type=int, default=0, help="mlp --precompile (jaxft.worker.warmup); 0: off")
    ap.add_argument("--fault-free-runs", type=int, choices=(1, 2), default=2,
                    help="2: the fault-free run before and after the faulty one, goodput against their mean")
    ap.add_argument("--pipeline", action="store_true", help="mlp --pipeline (jaxft.ElasticLoop) in every run")
    ap.add_argument("--commit-every", default="auto", help="mlp --commit_every (jaxft.ElasticLoop) in every run")
    ap.add_argument("--early-connect", action=argparse.BooleanOptionalAction, default=True,
                    help="jaxft launch --early-connect (its default) or --no-early-connect in every run")
    ap.add_argument("--spares", type=int, default=0, help="jaxft launch --spares in the faulty run")
    ap.add_argument("--nice-restarts", type=int, default=None,
                    help="jaxft launch --nice-restarts in the faulty run (default: jaxft launch's)")
    ap.add_argument("--standby", action=argparse.BooleanOptionalAction, default=True,
                    help="jaxft launch --standby in the faulty run (default on, as jaxft launch's)")
    ap.add_argument("--victims", default="1,1,1,1",
                    help="the processes killed at 12/24/36/48 s (issue 40's schedule: 1,2,3,0)")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="jaxft-issue13-")
    victims = [int(v) for v in args.victims.split(",")]
    if len(victims) != 4 or not all(0 <= v < 4 for v in victims):
        ap.error(f"--victims takes four process ids in [0, 4), got {args.victims!r}")
    kills = [f"kill:process={v}:after={t}s" for v, t in zip(victims, (12, 24, 36, 48))]
    opts = (args.reduction, args.precompile, args.pipeline, args.commit_every, args.early_connect)
    ff = run(base, "fault_free", args.steps, args.admission, [], *opts)
    ft = run(base, "jaxft", args.steps, args.admission, kills, *opts, spares=args.spares,
             nice_restarts=args.nice_restarts, standby=args.standby)
    refs = [ff]
    if args.fault_free_runs == 2:
        refs.append(run(base, "fault_free_after", args.steps, args.admission, [], *opts))
    ref_s = sum(r["train_s"] for r in refs) / len(refs)
    diff = params_diff(ft["params"], ff["params"])
    same_refs = all(params_diff(r["params"], ff["params"])["bitwise_equal"] for r in refs)
    out = {"victims": victims, "admission": args.admission, "reduction": args.reduction, "precompile": args.precompile,
           "pipeline": args.pipeline, "commit_every": args.commit_every, "early_connect": args.early_connect,
           "spares": args.spares, "nice_restarts": args.nice_restarts, "standby": args.standby,
           "goodput": round(ref_s / ft["train_s"], 3),
           "lost_per_kill_s": round((ft["train_s"] - ref_s) / len(kills), 3),
           "fault_free_train_s": [r["train_s"] for r in refs],
           "fault_free": {k: v for k, v in ff.items() if k != "params"},
           "jaxft": {k: v for k, v in ft.items() if k != "params"},
           "params_bitwise_equal": diff["bitwise_equal"], "params_max_rel_diff_per_leaf": diff["max_rel_diff_per_leaf"],
           "fault_free_runs_bitwise_equal": same_refs, "dirs": base}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

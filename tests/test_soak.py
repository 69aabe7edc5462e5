"""Soak: 4 processes, 100 steps, checkpoints every 10, and 25 faults drawn from a seed:
kills of any process (0 included) at every phase, two kills in one step, a kill-all, a
hang, a stop, kills during a save, a rehydration and a restore. Every process must end with
the same parameters, every step's commits must list the same members, the result must
equal the fault-free run's leaf by leaf, to the bit (the exact reduction), and nothing may be
left running.

`-m soak` (deselected by default). `JAXFT_SOAK_SEEDS=1,2,3` picks the seeds; each seed is
printed, so a failure can be replayed with it. `JAXFT_SOAK_LAUNCH="--no-early-connect"` adds
options to every faulty run's `jaxft launch`.
"""

from __future__ import annotations

import collections
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import MLP, PYTHON, by_event, events, launch, too_late_to_rejoin

pytestmark = pytest.mark.soak

N, STEPS, EVERY = 4, 100, 10
SEEDS = [int(s) for s in os.environ.get("JAXFT_SOAK_SEEDS", "1,2,3").split(",")]
LAUNCH = os.environ.get("JAXFT_SOAK_LAUNCH", "").split()
WORKER = [PYTHON, MLP, "--steps", str(STEPS), "--checkpoint_every", str(EVERY), "--check_every", "10",
          "--hidden", "16", "--step_sleep", "0.05", "--reduction", "exact", "--exact_chunks", "8"]
FIGURES = Path(os.environ.get("JAXFT_TEST_FIGURES_SOAK", "/tmp/jaxft-soak-figures.json"))


def schedule(seed: int, count: int = 25) -> list[str]:
    """``count`` fault specs from ``seed``: every kind at least once, the rest random kills."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(3, STEPS - 5), count))
    kinds = ["kill-all", "hang", "stop", "two", "save", "rehydrate", "restore"]
    kinds += ["kill"] * (count - len(kinds))
    rng.shuffle(kinds)
    phases = ["before-step", "after-grad", "after-commit"]
    specs = []
    for step, kind in zip(steps, kinds):
        p = rng.randrange(N)
        if kind == "kill-all":
            specs.append(f"kill-all:step={step}:phase=after-grad")
        elif kind == "hang":
            specs.append(f"hang:process={p}:step={step}:phase={rng.choice(phases)}")
        elif kind == "stop":
            specs.append(f"stop:process={p}:step={step}")
        elif kind == "two":
            q = rng.choice([x for x in range(N) if x != p])
            specs += [f"kill:process={p}:step={step}", f"kill:process={q}:step={step}"]
        elif kind == "save":  # checkpoint N is saved at the commit of step N - 1
            specs.append(f"kill:process={p}:step={(step // EVERY + 1) * EVERY}:phase=during-save")
        elif kind == "rehydrate":  # fires wherever a rehydration starts at that step
            specs.append(f"kill:process={p}:step={step}:phase=during-rehydrate")
        elif kind == "restore":  # fires on a cold restore of that checkpoint (after the kill-all)
            specs.append(f"kill:process={p}:step={(step // EVERY) * EVERY or EVERY}:phase=during-restore")
        else:
            specs.append(f"kill:process={p}:step={step}:phase={rng.choice(phases)}")
    return specs


def _params(run_dir: Path, processes=range(N)) -> dict[int, dict]:
    return {p: dict(np.load(run_dir / "final" / f"final-p{p}.npz")) for p in processes}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("soak-ref")
    r = launch(N, [*WORKER, "--final_params", str(run / "final")], run_dir=run, timeout=600)
    assert r.returncode == 0, r.describe()
    return _params(run)[0]


@pytest.mark.parametrize("seed", SEEDS)
def test_soak(seed, reference, tmp_path, marker):
    specs = schedule(seed)
    print(f"\nsoak seed {seed} ({len(specs)} faults): {' '.join(specs)}", file=sys.stderr)
    args = ["--restart", "on-failure", "--max-restarts", "40", "--heartbeat-timeout", "3", "--timeout", "step=4",
            *LAUNCH]
    for s in specs:
        args += ["--fault", s]
    r = launch(N, [*WORKER, "--final_params", str(tmp_path / "final"), marker], *args, run_dir=tmp_path,
               timeout=1500)
    assert r.returncode == 0, f"seed {seed}\n{r.describe()}"
    ev = events(tmp_path)
    finals = {}
    for e in by_event(ev, "final"):
        finals[e["process"]] = e
    # every process finished, or its last life was restarted too late to rejoin (ready admission)
    late = [p for p in range(N) if p not in finals and too_late_to_rejoin(ev, p)]
    assert sorted([*finals, *late]) == list(range(N)) and finals, f"seed {seed}: {sorted(finals)}, late {late}"
    assert len({f["params_sha256"] for f in finals.values()}) == 1, f"seed {seed}"
    # A cold restart (after the kill-all, or when the last member dies while the others still
    # set up) commits the steps after its checkpoint again: those are a new epoch. Within an
    # epoch every step's commits list one member set. A cold start's members begin again at
    # generation 1, and a commit of step s+1 is logged only after every member of step s
    # logged its commit of s: a new epoch starts at a commit whose generation is below the
    # epoch's or whose step goes backwards. (The step alone missed a cold start that
    # re-committed the step the lone member had just committed, then died with it.)
    members, epoch, top, generation = collections.defaultdict(set), 0, -1, 0
    for e in by_event(ev, "commit"):
        if e["step"] < top or e["generation"] < generation:
            epoch, top, generation = epoch + 1, -1, 0
        top, generation = max(top, e["step"]), max(generation, e["generation"])
        members[(epoch, e["step"])].add(tuple(e["members"]))
    assert sorted({s for _, s in members}) == list(range(STEPS)), f"seed {seed}"
    assert all(len(m) == 1 for m in members.values()), \
        f"seed {seed}: {[(k, m) for k, m in members.items() if len(m) > 1]}"
    worst = 0.0
    for _, leaves in _params(tmp_path, sorted(finals)).items():
        for name, value in leaves.items():
            ref = reference[name]
            worst = max(worst, float(np.max(np.abs(value.astype(np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30)))
    fired = len(by_event(ev, "fault"))
    data = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    data[str(seed)] = {"faults": len(specs), "fired": fired, "max_leaf_rel_diff": worst,
                       "wall_s": round(max(e["time"] for e in ev) - min(e["time"] for e in ev), 1),
                       "restarts": sum(len(by_event(ev, "restart", process=p)) for p in range(N))}
    FIGURES.write_text(json.dumps(data, indent=2))
    # The exact reduction: whatever widths the steps ran at, the fault-free run's bits.
    assert worst == 0.0, f"seed {seed}: largest relative leaf difference {worst:.3g} (must be bitwise equal)"

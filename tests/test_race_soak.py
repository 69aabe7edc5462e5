"""Soak of the races the correctness issue found, each with its trigger, many runs each.

* ``late``: a member killed in a step's commit query while another is late to it (the
  split commit);
* ``alone``: every member killed right after admitting a joiner whose restore is put off
  (the joiner left without members);
* ``data``: one member's data source raising at one step (one member's own exception);
* ``rebuild``: a member killed inside a data-plane rebuild's barriers (the rebuild barrier).

The steps, the processes and the lateness are drawn from the run's index. Every run must
end with every final identical, equal to the fault-free run's to the bit (the exact
reduction), and every step committed once by each life, by one member set (but after the
members all died, when the steps since the newest checkpoint run again).

``-m soak`` (deselected by default). ``JAXFT_RACE_RUNS`` (default 20) sets the runs per race.
"""

from __future__ import annotations

import os
import random

import pytest
from helpers import MLP, REPO, by_event, commits_by_step, finals, train

pytestmark = pytest.mark.soak

N, STEPS = 3, 60
RUNS = int(os.environ.get("JAXFT_RACE_RUNS", "20"))
WORKER_RUNS = str(REPO / "tests" / "workers" / "mlp_runs.py")


def worker(race: str) -> list[str]:
    """The worker of a race (the same for its fault-free reference). ``alone`` and ``rebuild``
    run long enough for a restart to be admitted (its admission rebuilds the data plane)."""
    if race in ("data", "alone"):
        return [WORKER_RUNS, "--runs", str(STEPS if race == "data" else 4 * STEPS), "--reduction", "exact",
                "--step_sleep", "0.03", *(["--checkpoint_every", "5"] if race == "alone" else [])]
    steps = 4 * STEPS if race == "rebuild" else STEPS
    return [MLP, "--steps", str(steps), "--reduction", "exact", "--step_sleep", "0.04", "--check_every", "0"]


def trigger(race: str, i: int) -> tuple[list[str], list[str]]:
    """``(faults, worker options)`` of run ``i`` of ``race``."""
    rng = random.Random(f"{race}-{i}")
    p, q = rng.sample(range(N), 2)
    step = rng.randrange(5, 25)
    if race == "late":
        late = rng.choice([0.15, 0.25, 0.35, 0.45])
        return [f"kill:process={p}:step={step}:phase=in-commit",
                f"hang:process={q}:step={step}:phase=after-grad:for={late}s"], []
    if race == "alone":
        return [f"kill:process={p}:step={step}"] + [f"kill:process={r}:step={step + 1}:phase=admitting"
                                                   for r in range(N) if r != p], []
    if race == "data":
        return [], ["--fail_batch", f"{p}:{step}:{rng.choice([1, 2, 3])}"] + (["--pipeline"] if i % 2 else [])
    if race == "rebuild":
        return [f"kill:process={p}:step={step}", f"kill:process={q}:step={step + 1}:phase=during-rebuild"], []
    raise ValueError(race)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    shas = {}
    for race in ("late", "alone", "data", "rebuild"):
        key = tuple(worker(race))
        if key in shas:
            continue
        proc, evts = train(tmp_path_factory.mktemp(f"ref-{race}"), *key, n=N, timeout=300)
        assert proc.returncode == 0, proc.describe()
        shas[key] = finals(evts)[0]["params_sha256"]
    return shas


@pytest.mark.parametrize("i", range(RUNS))
@pytest.mark.parametrize("race", ["late", "alone", "data", "rebuild"])
def test_race(race, i, references, tmp_path):
    faults, extra = trigger(race, i)
    base = worker(race)
    proc, evts = train(tmp_path, *base, *extra, n=N, faults=faults, restart="on-failure", timeout=300)
    assert proc.returncode == 0, proc.describe()
    shas = {f["params_sha256"] for f in finals(evts)}
    assert shas == {references[tuple(base)]}, (faults, extra, finals(evts))
    for step, commits in commits_by_step(evts).items():
        # (every member died in "alone": the steps since the newest checkpoint run again, once)
        lives = {(c["process"], c["incarnation"]) for c in commits}
        assert len(lives) == len(commits), (step, commits)
        if race != "alone":
            assert len({tuple(c["members"]) for c in commits}) == 1, (step, commits)
    fired = {e["spec"] for e in by_event(evts, "fault")}
    assert len(fired) == len(faults), (faults, sorted(fired))  # every trigger fired
    print(f"race {race} run {i}: faults {faults} {extra}: {len(finals(evts))} finals, "
          f"{len(by_event(evts, 'desync'))} desync, {len(by_event(evts, 'step_failed'))} failed attempts")

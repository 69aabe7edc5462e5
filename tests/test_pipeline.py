"""``pipeline``: step k+1's program starts before step k's commit query; nothing changes in
what commits. Real processes, a real coordination service, real SIGKILL.

The exact reduction makes a step's bits independent of the width, so every run here must
end with the one-process sequential run's ``params_sha256``."""

import json

import pytest
from helpers import (
    EXACT,
    MLP,
    PYTHON,
    check_agreed_run,
    commits_by_step,
    finals,
    run_jaxft,
    stop_with_checkpoint,
    too_late_to_rejoin,
    train,
)
from helpers import by_event as of

STEPS = 30


@pytest.fixture(scope="module")
def sequential_runs(one_process_exact):
    """``steps -> params_sha256`` of the one-process run without pipeline."""
    return one_process_exact


@pytest.fixture
def sequential(sequential_runs):
    return sequential_runs(STEPS)


def test_a_pipelined_run_starts_every_step_but_the_first_early_and_computes_the_same(sequential, tmp_path):
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), *EXACT, "--pipeline", n=2)
    assert proc.returncode == 0, proc.describe()
    check_agreed_run(events, STEPS, 2)
    for f in finals(events):
        assert f["params_sha256"] == sequential
        # the first step has no step before it; every other one started during the last commit
        assert (f["started_early"], f["left_early"]) == (STEPS - 1, 0), f


def test_a_member_killed_before_the_commit_query_leaves_the_early_program(sequential, tmp_path):
    # Killed at after-grad: its gradients are in the all-reduce, so the survivors' program
    # ends, they start the next step's, then the commit query finds the member dead: that
    # early program is left, and the step retried on the survivors.
    faults = ["kill:process=0:step=8", "kill:process=2:step=15"]
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), *EXACT, "--pipeline", faults=faults)
    assert proc.returncode == 1, proc.describe()  # two workers died and were not restarted
    survivor = [e["step"] for e in of(events, "commit") if e["process"] == 1]
    assert survivor == list(range(STEPS)), "each step committed exactly once"
    for step, commits in commits_by_step(events).items():
        assert len({tuple(c["members"]) for c in commits}) == 1, f"step {step}: members disagree"
    failed = [e["step"] for e in of(events, "step_failed", process=1)]
    assert 8 in failed and 15 in failed, failed
    (final,) = finals(events)
    assert final["process"] == 1 and final["step"] == STEPS
    assert final["left_early"] == 2, final  # steps 9 and 16, started early and left
    assert final["params_sha256"] == sequential, "3, 2 then 1 devices, pipelined: the same bits"
    assert not of(events, "hung"), of(events, "hung")


@pytest.mark.soak  # time budget: test_commit_every's rejoin runs with --pipeline too
def test_a_restarted_member_rejoins_a_pipelined_run(sequential_runs, tmp_path):
    # a kill inside the step's program, then a rejoin: no early program crosses an admission
    steps = 60  # (at 0.15 s a step, the restarted process has ~8 s to set up)
    sequential = sequential_runs(steps)
    faults = ["kill:process=1:step=6:phase=in-step"]
    proc, events = train(tmp_path, MLP, "--steps", str(steps), *EXACT, "--pipeline", "--step_sleep", "0.15",
                         faults=faults, restart="on-failure")
    assert proc.returncode == 0, proc.describe()
    assert of(events, "rehydrated") or too_late_to_rejoin(events, 1), "process 1 rejoined"
    fs = finals(events)
    assert {f["params_sha256"] for f in fs} == {sequential}, fs
    assert len({f["process"] for f in fs}) == 3 or too_late_to_rejoin(events, 1)
    commits = commits_by_step(events)
    assert sorted(commits) == list(range(steps))
    for step, cs in commits.items():
        assert len({tuple(c["members"]) for c in cs}) == 1, f"step {step}: members disagree"


def test_the_overhead_bench_runs_the_pipelined_step_beside_its_floor(tmp_path):
    # the figures' presence and sense only: its timings are for people (no timed assertions)
    out = tmp_path / "overhead.json"
    r = run_jaxft("bench", "overhead", "-n", "2", "--steps", "20", "--hidden", "32", "--global-batch", "64",
                  "--pipeline", "--json", str(out), timeout=120)
    assert r.returncode == 0, r.describe()
    assert "pipeline" in r.stdout and "floor (plain + one coordination-service round trip" in r.stdout, r.stdout
    figures = json.loads(out.read_text())
    assert figures["pipeline"] is True and figures["steps"] == 20
    assert figures["started_early"] >= 20, figures  # (its 3 warm-up steps, then 20 timed: all but the first)
    for key in ("elastic_ms", "plain_ms", "floor_ms"):
        assert figures[key] > 0, figures
    assert figures["floor_ratio"] == pytest.approx(figures["floor_ms"] / figures["plain_ms"], rel=1e-2)


def test_one_members_fault_rule_keeps_every_member_from_starting_early(sequential, tmp_path):
    # Only process 0 has a rule at step 10, yet no member may start step 10 early: the others
    # would then wait in their early program's all-reduce (settling before on_commit) while
    # process 0, running step 9's on_commit in step, joins the checkpoint save's collectives
    # instead: each waits for the other until gloo's timeout (seen in the main job). The
    # decision rides in the step's votes, so every member makes the same one.
    faults = ["kill:process=0:step=10"]
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), *EXACT, "--pipeline", "--checkpoint_every", "5",
                         faults=faults)
    assert proc.returncode == 1, proc.describe()  # process 0 died and was not restarted
    exits = [e for e in of(events, "exit") if e.get("code") not in (None, 0)]
    assert exits == [], f"only the killed process may fail: {exits}"
    survivors = finals(events)
    assert sorted(f["process"] for f in survivors) == [1, 2], survivors
    assert {f["params_sha256"] for f in survivors} == {sequential}, survivors
    for f in survivors:
        # not step 0 (no step before it) nor step 10 (the rule's; retried after the kill at its
        # after-grad point); step 11, started before step 10's failed commit query, was left
        assert (f["started_early"], f["left_early"]) == (STEPS - 2, 1), f
    assert not of(events, "hung") and not of(events, "abandoned"), events


def test_a_stop_ends_a_pipelined_run_at_one_step_with_its_checkpoint(tmp_path, marker):
    # SIGTERM: the members agree on a step to stop at, save there (on_commit, after the early
    # program settled) and exit; the step started early meanwhile ends before they do
    worker = [PYTHON, MLP, "--steps", "400", "--step_sleep", "0.05", "--checkpoint_every", "1000", "--hidden", "16",
              "--pipeline", marker]
    ev, _ = stop_with_checkpoint(tmp_path / "run", worker)
    assert not of(ev, "hung") and not of(ev, "abandoned"), ev

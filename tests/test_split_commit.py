"""Members never disagree on whether a step committed, and never mix two steps' states.

The race (issue: a split commit): members {0, 1, 2} in step K's commit query; process 2
enters it and dies; its launcher records the death, so process 0 stops waiting and asks
again without 2; process 1, late to the query (slow after its gradients), asks the query
process 0 left, which the service completes with 2 still in it (it notices deaths only by
heartbeat): 1 committed K while 0 failed K, and their next steps paired K+1 with K in one
all-reduce, for the rest of the run.

Two guards, tested here: the launcher gives a process it saw die a new incarnation in the
service before it records the death (``jaxft._compat.retire_life``), and a member confirms
any answer in which a member's life changed with one more query over the survivors, which
meets the query of those that left (``jaxft.worker.deaths.DeathWatch``); and every step's own
all-reduce carries each member's step number (``jaxft.core.votes``), so members at different steps
fail that step everywhere and the next one brings those behind to the latest step.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import MLP, PYTHON, by_event, clean_env, commits_by_step, events, finals, run_jaxft, train, wait_for
from service_model import ServiceModel

from jaxft import protocol
from jaxft.core import votes
from jaxft.worker import deaths

# -- the model: the service's matching rule, the members' real DeathWatch -----------------------

def _late_member_while_another_dies(tmp_path, *, retire: bool, confirm: bool) -> tuple[dict, list]:
    """Members 0 and 1 (threads, each with its own DeathWatch) at step K's commit query over
    {0, 1, 2}; 2 asks and dies; its launcher retires its life (``retire``) and records the
    death; 0 asks again without it; then 1 asks, late. Each member then makes its next query
    (a failed step's retry: the entry query over the survivors; a commit: the next step's
    commit query). Returns each member's decision and the service's completed queries."""
    svc = ServiceModel(3, wait_s=5.0)
    entry = dict(svc.incarnation)
    decisions: dict[int, str] = {}
    errors: list[BaseException] = []
    watches = {p: deaths.DeathWatch(str(tmp_path), poll_s=0.002) for p in (0, 1)}
    for watch in watches.values():  # both entered step K before process 2 died
        watch.saw(entry)

    def member(p: int) -> None:
        try:
            watch = watches[p]
            label = [0]

            def query(pids):
                return svc.ask(p, pids, label=label[0])

            answer = watch.live_nodes(query, [0, 1, 2], lives=entry if confirm else None)
            failed = {q for q, i in entry.items() if answer.get(q) != i}
            decisions[p] = "fail" if failed else "commit"
            label[0] = 1  # the member's next query
            if failed:
                survivors = sorted(q for q in answer if q not in failed)
                watch.live_nodes(query, survivors)
            else:
                watch.live_nodes(query, sorted(answer), lives=answer if confirm else None)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    first = threading.Thread(target=member, args=(0,), daemon=True)
    first.start()
    wait_for(lambda: svc.waiting(0, [0, 1, 2]), timeout=5, what="member 0 in the query")
    threading.Thread(target=lambda: svc.ask(2, [0, 1, 2], label=0), daemon=True).start()
    wait_for(lambda: svc.waiting(2, [0, 1, 2]), timeout=5, what="process 2 in the query")
    # process 2 dies here; its launcher sees the exit
    if retire:
        svc.new_life(2)
    protocol.record_death(str(tmp_path), 2, 0)
    wait_for(lambda: svc.waiting(0, [0, 1]), timeout=5, what="member 0 asking again without 2")
    late = threading.Thread(target=member, args=(1,), daemon=True)
    late.start()
    first.join(3)
    late.join(3)
    assert not errors, errors
    if first.is_alive() or late.is_alive():  # a member waits for a query the other never makes
        decisions["stuck"] = "yes"
    # the members' queries: every instance they met in must be the same query of each of them
    met = [(tasks, {p: lab for p, lab in asked.items() if p in (0, 1)}) for tasks, asked, _ in svc.completed]
    return decisions, met


def test_the_service_model_splits_the_old_protocol(tmp_path):
    # What the issue saw, in the model: the late member commits, the other fails, and their
    # next queries meet each other's previous ones (one member a query ahead from then on).
    decisions, met = _late_member_while_another_dies(tmp_path, retire=False, confirm=False)
    assert decisions[0] == "fail" and decisions[1] == "commit", decisions
    assert any(len(set(labels.values())) > 1 for _, labels in met), met


def test_a_retired_life_without_confirmation_still_leaves_a_member_a_query_ahead(tmp_path):
    # Both fail the step (the late answer names 2's new life), but without the confirmation
    # the late member's next query met the other's re-asked one.
    decisions, met = _late_member_while_another_dies(tmp_path, retire=True, confirm=False)
    assert decisions[0] == decisions[1] == "fail", decisions
    assert any(len(set(labels.values())) > 1 for _, labels in met), met


def test_a_late_member_fails_the_step_with_the_others_and_stays_in_step(tmp_path):
    decisions, met = _late_member_while_another_dies(tmp_path, retire=True, confirm=True)
    assert decisions == {0: "fail", 1: "fail"}, decisions
    assert all(len(set(labels.values())) == 1 for _, labels in met), met
    # and the members' last queries met: both made their retry's entry query together
    assert any(labels == {0: 1, 1: 1} for _, labels in met), met


# -- the step votes --------------------------------------------------------------------------

def _total(*rows: np.ndarray) -> np.ndarray:
    from jaxft.worker.programs import agreed_votes

    return np.asarray(agreed_votes(np.sum(np.stack(rows).astype(np.float32), axis=0)))


def test_the_step_votes_tell_members_at_different_steps_apart():
    same = votes.read(_total(votes.empty(3, 41), votes.empty(3, 41), votes.empty(3, 41)), devices=3)
    assert same.same_step and not same.failed and same.quiet
    for a, b in ((41, 42), (0, 1 << 39), (7, 7 + 1024), (12345, 12344)):
        v = votes.read(_total(votes.empty(3, a), votes.empty(3, b), votes.empty(3, a)), devices=3)
        assert not v.same_step, (a, b)


def test_the_votes_carry_fail_commit_and_admission():
    adm = np.array([0, 0, votes.READY], np.int32)
    v = votes.read(_total(votes.row(adm, 5, commit=True), votes.row(np.zeros(3, np.int32), 5, fail=True)), devices=2)
    assert v.failed == 1 and v.commit and not v.not_ahead and v.same_step
    assert v.admission.tolist() == [0, 0, votes.READY] and not v.quiet
    held = votes.read(_total(votes.row(np.array([0, 0, votes.HOLD], np.int32), 5),
                             votes.row(adm, 5, not_ahead=True)), devices=2)
    assert held.admission.tolist() == [0, 0, votes.HOLD] and held.not_ahead


# -- real processes ----------------------------------------------------------------------------

STEPS = 40
# process 1 is 0.4 s late: past the kill (0.1 s into process 2's query) and the launcher's record
# of it, within the 0.5 s a member may stay in a step whose member died (jaxft.worker.hang)
LATE_AND_DEAD = ["kill:process=2:step=10:phase=in-commit", "hang:process=1:step=10:phase=after-grad:for=0.4s"]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    d = tmp_path_factory.mktemp("fault-free")  # (one process: the exact reduction's bits are the same at any width)
    proc, evts = train(d, MLP, "--steps", str(STEPS), "--reduction", "exact", n=1)
    assert proc.returncode == 0, proc.describe()
    return finals(evts)[0]["params_sha256"]


def test_a_member_late_to_the_commit_while_another_dies_does_not_split_the_run(tmp_path, fault_free):
    # Process 2 is killed in step 10's commit query (the query sent), while process 1 is still
    # 1.5 s from asking it (alive, after its gradients). Before: process 1 committed step 10
    # alone and ran one step ahead of process 0 to the end, every all-reduce pairing step k
    # with k+1 (finals differed, in 5 of 6 runs).
    proc, evts = train(tmp_path, MLP, "--steps", str(STEPS), "--reduction", "exact", "--step_sleep", "0.05", n=3,
                       faults=LATE_AND_DEAD, restart="on-failure")
    assert proc.returncode == 0, proc.describe()
    by_step = commits_by_step(evts)
    assert sorted(by_step) == list(range(STEPS)), sorted(by_step)
    for step, commits in by_step.items():  # each step committed once, by one member set
        assert len({tuple(c["members"]) for c in commits}) == 1, (step, commits)
        assert len({c["process"] for c in commits}) == len(commits), (step, commits)
    shas = [f["params_sha256"] for f in finals(evts)]
    assert len(shas) >= 2 and set(shas) == {fault_free}, proc.describe()
    assert by_event(evts, "fault", process=2), "the kill did not fire"
    # step 10 failed for both survivors (none committed it with process 2's dead life)
    tenth = {e["process"] for e in by_event(evts, "step_failed", step=10)}
    assert {0, 1} <= tenth, by_event(evts, "step_failed")


def test_without_the_launchers_retirement_the_step_votes_bring_the_members_back_together(tmp_path, fault_free):
    # The same race where the launcher cannot retire the dead life (another node's agent, a
    # host that died whole; JAXFT_RETIRE_LIVES=0 here): the late member commits step 10 alone.
    # Its next step and the others' retry of step 10 meet in one program, whose step votes
    # differ: that step fails everywhere (``desync``) and the next one rehydrates the members
    # behind from the one ahead, so the run ends with the fault-free bits.
    options = ["launch", "-n", "3", "--restart", "on-failure", "--console", "raw", "--run-dir", str(tmp_path)]
    for f in LATE_AND_DEAD:
        options += ["--fault", f]
    proc = run_jaxft(*options, "--", PYTHON, MLP, "--steps", str(STEPS), "--reduction", "exact", "--step_sleep",
                     "0.05", timeout=240, env=clean_env(JAXFT_RETIRE_LIVES="0"))
    evts = events(tmp_path)
    assert proc.returncode == 0, proc.describe()
    shas = [f["params_sha256"] for f in finals(evts)]
    assert len(shas) >= 2 and set(shas) == {fault_free}, proc.describe()
    desync = by_event(evts, "desync")
    assert sorted(e["process"] for e in desync) == [0, 1], desync  # one step, failed by both
    assert by_event(evts, "rehydrated", process=0, donor=1) or by_event(evts, "rehydrated", process=1, donor=0)

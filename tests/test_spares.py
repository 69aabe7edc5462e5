"""Hot spares (``jaxft launch --spares K``, :mod:`jaxft.core.spares`): the decisions, the
launcher's part, and a real run where a spare takes a killed member's place before the
next commit."""

from __future__ import annotations

import argparse
import time

import numpy as np
import pytest
from helpers import EXACT, MLP, PYTHON, REPO, by_event, check_agreed_run, events, launch, train

from jaxft import protocol
from jaxft.cli import _workers
from jaxft.core import spares
from jaxft.core.votes import HOLD, READY
from jaxft.errors import LaunchError
from jaxft.supervisor.launch_config import Service, Topology
from jaxft.worker.hang import WAIT_NOTICE_S
from jaxft.worker.warmup import swaps


# -- the decisions (pure) ---------------------------------------------------------------------
def test_at_full_width_a_ready_joiner_is_not_voted_in_and_a_hold_stays():
    votes = np.array([0, 0, READY, HOLD, READY], np.int32)
    assert list(spares.own_admission(votes, (0, 1), width=2)) == [0, 0, 0, HOLD, 0]
    assert list(spares.own_admission(votes, (0,), width=2)) == list(votes)  # below the width: unchanged
    assert list(spares.own_admission(votes, (0, 1), width=None)) == list(votes)  # no spares: unchanged
    assert list(votes) == [0, 0, READY, HOLD, READY]  # (not modified in place)


def test_below_the_width_the_members_vote_first_and_admit_only_what_the_width_has_room_for():
    assert spares.swap_first((0, 2), width=3) and not spares.swap_first((0, 1, 2), width=3)
    assert not spares.swap_first((0,), width=None)
    agreed = np.array([0, 0, READY, READY, HOLD], np.int32)
    assert spares.to_admit(agreed, (0, 1), width=3) == (2,)  # the lowest first, one place free
    assert spares.to_admit(agreed, (0,), width=3) == (2, 3)
    assert spares.to_admit(agreed, (0, 1, 5), width=3) == ()  # full
    assert spares.to_admit(agreed, (0,), width=None) == (2, 3)  # no spares: every ready joiner
    assert spares.to_admit(np.array([READY, READY]), (0,), width=None) == (1,)  # never a member


def test_the_swap_decision_after_a_failure_is_named_by_the_failed_steps_lives():
    # every survivor of one failed step names it alike (whatever the map's order); a later
    # failure over the same processes holds another life, so it never reads an old decision
    assert spares.swap_key({2: 0, 0: 0, 1: 3}) == spares.swap_key({0: 0, 1: 3, 2: 0}) == "0.0,1.3,2.0"
    assert spares.swap_key({0: 0, 1: 3, 2: 0}) != spares.swap_key({0: 0, 1: 4, 2: 0})


def test_a_ready_key_left_by_a_life_that_died_waiting_is_not_voted_in():
    from jaxft.worker.admission import fresh_ready

    entries = [("jaxft/ready/2/old", "100.0"), ("jaxft/ready/3/a", "105.0"), ("jaxft/ready/4/x", "ready")]
    # process 2 announced at 100 and died at 103 (a spare killed while it waited): stale; 3 is
    # fresh (its process died before it announced); 4's value is no time: skipped
    assert fresh_ready(entries, {2: 103.0, 3: 104.0, 4: 0.5}) == {3: "a"}
    # the restart of 2 announced at 108: its key is voted, not the one its dead life left
    assert fresh_ready([*entries, ("jaxft/ready/2/new", "108.0")], {2: 103.0}) == {2: "new", 3: "a"}
    # on another node no record is read here, but 3's launcher retired its newest life: every
    # key of 3 is older than that death (a life registers before it announces)
    assert fresh_ready(entries, {}, retired={3}) == {2: "old"}


def test_a_ready_key_whose_life_its_launcher_retired_is_not_voted_on_another_node(tmp_path):
    """Real processes and service: process 1 announces itself ready and dies (SIGKILL) with its
    key left in the service; process 0's watcher, given no death records (another node's view),
    voted it while it lived and stops once the launcher wrote 1's life retired."""
    r = launch(2, [PYTHON, str(REPO / "tests" / "workers" / "stale_ready.py")], "--heartbeat-timeout", "10",
               run_dir=tmp_path, timeout=120)
    evts = events(tmp_path)
    assert not by_event(evts, "retire_failed"), by_event(evts, "retire_failed")  # (else the heartbeat's case)
    (e,) = by_event(evts, "stale_ready")
    assert (e["before"], e["retired"], e["after"]) == (READY, True, 0), (e, r.describe())
    assert e["keys"] == ["jaxft/ready/1/test"], e  # (the key was still there: the record decided)


def test_a_cold_start_is_every_process_but_the_spares():
    assert spares.initial({3}, 4) == (0, 1, 2)
    assert spares.initial(frozenset(), 2) == (0, 1)
    with pytest.raises(ValueError, match="not in 0..3"):
        spares.initial({4}, 4)
    with pytest.raises(ValueError, match="leave no member"):
        spares.initial({0, 1}, 2)


def test_the_warm_up_compiles_each_swap_of_a_member_for_a_spare():
    assert swaps((0, 1, 2), (3,)) == [(0, 1, 3), (0, 2, 3), (1, 2, 3)]
    assert swaps((0, 1), ()) == []


# -- the launcher's part ------------------------------------------------------------------------
def test_the_spares_are_the_last_workers_of_each_node_and_reach_the_workers_env():
    assert Topology(3, spares=1).spare_ids == (2,)
    assert Topology(3, nnodes=2, node_rank=1, spares=1, service=Service("10.0.0.1:1234")).spare_ids == (2, 5)
    assert Topology(2).spare_ids == ()
    assert protocol.spares({protocol.SPARES: "2,5"}) == {2, 5} and protocol.spares({}) == frozenset()
    with pytest.raises(ValueError, match="JAXFT_SPARES"):
        protocol.spares({protocol.SPARES: "two"})
    with pytest.raises(LaunchError, match="no worker to train"):
        Topology(1, spares=1).validate()


def _args(**kw) -> argparse.Namespace:
    base = dict(gpus="none", num_processes=2, spares=1)
    base.update(kw)
    return argparse.Namespace(**base)


def test_spares_are_workers_beyond_n_and_take_gpus_too(monkeypatch):
    assert _workers(_args())[0] == 3
    monkeypatch.setattr("jaxft.cli.detect_gpus", lambda: [0, 1, 2, 3])
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    n, gpus, _ = _workers(_args(gpus="auto", num_processes=None))
    assert (n, gpus) == (4, [0, 1, 2, 3])  # 3 members and a spare on 4 GPUs
    with pytest.raises(LaunchError, match="1 of them spares"):
        _workers(_args(gpus="auto", num_processes=4))
    with pytest.raises(LaunchError, match="--spares must be >= 0"):
        _workers(_args(spares=-1))


# -- a real run -----------------------------------------------------------------------------------
STEPS = 100  # (the length of test_commit_every's rejoin: one 1-process reference for both)
KILL_2 = 85  # (0.14 s a step: ~10 s between process 1's death and the one its restart replaces)


@pytest.mark.smoke
def test_a_spare_runs_the_checks_then_its_own_set_up_instead_of_a_joiners():
    """Before it says it is ready, a spare cannot compile for a member set it does not know: it
    runs the checks, then the hooks registered with ``spare`` (the loop's: name the shared
    programs, which its first step after a swap otherwise did while the members waited,
    ``Precompiler.as_spare``); any other joiner runs the checks and the other hooks."""
    import contextlib

    from jaxft.timeouts import Timeouts
    from jaxft.worker.joining import Joining

    class Hang:
        busy = staticmethod(contextlib.nullcontext)

    calls: list[tuple[str, tuple[int, ...]]] = []
    j = Joining(0, Timeouts(), Hang(), None, None, lambda: False, False)  # type: ignore[arg-type]
    j.before_admission(lambda pids: calls.append(("compile", pids)))
    j.before_admission(lambda pids: calls.append(("spare", pids)), spare=True)
    j.before_admission(lambda pids: calls.append(("check", pids)), may_raise=True)
    j.before_admission(lambda pids: calls.append(("ready", pids)), announced=True)
    j._set_up((0, 1, 2), compile_ahead=False)  # a spare
    assert calls == [("check", (0, 1, 2)), ("spare", (0, 1, 2))]
    calls.clear()
    j._set_up((0, 1), compile_ahead=True)  # a joiner the members wait for
    assert calls == [("check", (0, 1)), ("compile", (0, 1))]


def test_spares_take_the_places_of_killed_members_and_restarts_become_spares(tmp_path, one_process_exact):
    """Two members (0, 1) and a spare (2), 100 steps, exact reduction.

    * The spare dies right after it said it is ready (``phase=ready``): its ready key stays in
      the service, but no member may count a life that died since it announced.
    * Process 1 dies at step 8: no live spare is ready (2's restart waits out the heartbeat,
      8 s, + 1.5 s: the dead spare was in nobody's view, so nobody's mark lets it connect early;
      the members' first step and seven more took up to 6.1 s on a loaded machine, and with a
      3 s heartbeat the restart was once ready first), so process 0 retries alone and trains on
      at width 1, asking before every step;
      when 2's restart is ready it is voted in before a step (``before_step``), or at the
      commit of a step it became ready during (the step's own votes), and the step it enters
      commits at width 2.
    * Process 2 dies at step 85: process 1's restart waits as the spare by then, and the
      survivor proposes it at once (``after_failure``): step 85's retry commits at width 2.
    * Process 2's restart waits to the end (exits 0, in no commit); the params are the bits of
      a 1-process run."""
    proc, evts = train(tmp_path, MLP, "--steps", str(STEPS), "--step_sleep", "0.14", *EXACT, n=2,
                       restart="on-failure", extra=["--spares", "1", "--heartbeat-timeout", "8"],
                       faults=["kill:process=2:step=0:phase=ready", "kill:process=1:step=8:phase=after-grad",
                               f"kill:process=2:step={KILL_2}:phase=after-grad"])
    why = proc.describe()
    assert proc.returncode == 0, why
    [start] = by_event(evts, "run_start")
    assert start["num_processes"] == 3 and start["spares"] == [2], start
    assert by_event(evts, "fault", process=2, incarnation=0, phase="ready"), why
    by_step = check_agreed_run(evts, STEPS, n=2)  # (the spare that waits to the end logs no final)
    assert by_step[7][0]["members"] == [0, 1] and by_step[8][0]["members"] == [0], why  # (the dead spare's key)
    [late, fast] = by_event(evts, "admit")
    assert (late["joiners"], late["width"], late.get("after_failure")) == ([2], 2, None), late
    assert 8 < late["step"] < KILL_2 and by_step[late["step"]][0]["members"] == [0, 2], (late, why)
    assert (fast["step"], fast["joiners"], fast.get("after_failure")) == (KILL_2, [1], True), fast
    assert by_step[KILL_2][0]["members"] == [0, 1], "the spare entered the failed step's retry"
    assert {tuple(c[0]["members"]) for s, c in by_step.items() if s >= KILL_2} == {(0, 1)}, why
    # The late admission entered (0, 2), a list nobody had stepped on: the members kept their
    # backend (a fresh communicator); the swap at KILL_2 entered (0, 1), which process 1's first
    # life had stepped on: its communicator is stale, so every member rebuilt (jaxft.core.plane).
    synced = {(e["step"], e["process"]): e["rebuilt"] for e in by_event(evts, "data_plane") if e["step"] > 0}
    assert synced == {(late["step"], 0): False, (late["step"], 2): False, (KILL_2, 0): True, (KILL_2, 1): True}, synced
    hydrated = {(e["process"], e["incarnation"], e["step"], e["donor"]) for e in by_event(evts, "rehydrated")}
    assert hydrated == {(2, 1, late["step"], 0), (1, 1, KILL_2, 0)}, hydrated
    # process 2's last restart waited as the spare: never admitted, exited 0 when the run ended
    assert not by_event(evts, "commit", process=2, incarnation=2), why
    assert [e.get("code") for e in by_event(evts, "exit", process=2, incarnation=2)] == [0], why
    assert {f["params_sha256"] for f in by_event(evts, "final")} == {one_process_exact(STEPS)}, why
    # every backend a rebuild replaced was freed: one left alive keeps its gloo communicators,
    # whose pair with a dead peer can spin a core (jaxft.worker.dataplane)
    assert [f["replaced_backends_alive"] for f in by_event(evts, "final")] == [0, 0], why


def test_a_spare_waiting_to_be_admitted_never_says_it_waits_on_a_member():
    """A published wait makes a member past its step deadline exit as hung; a spare waits for a
    death, so its wait (``notice=False``) is never published, however long."""
    from jaxft.timeouts import Timeouts
    from jaxft.worker.watchdog import Watchdog

    class Hang:  # what the watchdog tells the step monitor
        def __init__(self):
            self.said: list[str] = []

        def phase(self, what):
            pass

        def waiting(self, what):
            self.said.append(what)

        def done_waiting(self):
            self.said.append("done")

    hang = Hang()
    dog = Watchdog(0, Timeouts(), hang, run_finished=lambda: False, poll_s=0.05)
    with dog.watch("waiting to be admitted", notice=False):
        time.sleep(WAIT_NOTICE_S + 0.3)
    assert hang.said == []
    with dog.watch("entering a step"):
        time.sleep(WAIT_NOTICE_S + 0.3)
    assert hang.said == ["entering a step", "done"]  # (the check above can fail)

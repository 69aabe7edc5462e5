"""The acceptance runs: real jax workers all-reducing while one of them is SIGKILLed."""

import pytest
from helpers import ALLREDUCE_WORKER, PYTHON, by_event, events, launch, summary

WORKER = [PYTHON, str(ALLREDUCE_WORKER), "--seconds", "12"]  # the acceptance run
# Without a restart, a worker killed before every worker got through jax's start-up (the
# service waits for all to register; the CPU backend exchanges its topology) leaves the
# others stuck until the initialization timeout. The launcher's after= clock also starts
# before its coordinator (and the jax import behind it) is up, so give start-up on a busy
# 2-core machine more room than the 6 s of the restart run.
KILL_1_AFTER, KILL_1_SECONDS = "8s", "14"


def test_killed_process_0_is_restarted_and_the_others_keep_going(run_dir):
    r = launch(3, WORKER, "--restart", "on-failure", "--fault", "kill:process=0:after=6s",
               run_dir=run_dir, timeout=120)
    assert r.returncode == 0, r.describe()
    ev = events(run_dir)
    why = r.describe()

    [fault] = by_event(ev, "fault", process=0)
    assert fault["action"] == "kill" and fault["spec"] == "kill:process=0:after=6s", fault
    [death] = by_event(ev, "exit", process=0, incarnation=0)
    assert death["signal"] == "SIGKILL", death
    # After the kill, processes 1 and 2 (never restarted) kept all-reducing. (Whether all
    # three got to all-reduce before the kill depends on how fast jax starts here.)
    after = [e for e in by_event(ev, "allreduce") if e["time"] > death["time"]]
    for p in (1, 2):
        assert [e for e in after if e["process"] == p and e["incarnation"] == 0], f"process {p}\n{why}"

    # Process 0 came back exactly once, as incarnation 1, and started working.
    restarts = by_event(ev, "restart", process=0)
    assert len(restarts) == 1 and restarts[0]["incarnation"] == 1, restarts
    assert by_event(ev, "restart", process=1) == [] and by_event(ev, "restart", process=2) == []
    assert by_event(ev, "worker_start", process=0, incarnation=1), why
    assert [e["incarnation"] for e in by_event(ev, "launch", process=0)] == [0, 1]

    s = summary(run_dir)
    assert s["restarts"] == {"0": 1, "1": 0, "2": 0}
    assert s["exit_code"] == 0
    assert s["final_returncodes"] == {"0": 0, "1": 0, "2": 0}
    for p in (1, 2):
        assert by_event(ev, "worker_done", process=p), f"process {p} did not finish\n{why}"
    # The survivors noticed the death (a failed round) or the restart, never a wrong sum.
    for e in by_event(ev, "allreduce"):
        assert e["value"] == sum(m + 1 for m in e["members"]), e


@pytest.mark.soak  # long: the default suite stays under its time budget
def test_killed_process_1_without_restart_leaves_0_and_2_working(run_dir):
    worker = [PYTHON, str(ALLREDUCE_WORKER), "--seconds", KILL_1_SECONDS]
    r = launch(3, worker, "--restart", "never", "--fault", f"kill:process=1:after={KILL_1_AFTER}",
               run_dir=run_dir, timeout=100)
    assert r.returncode == 1, r.describe()  # a worker died and was not restarted
    ev = events(run_dir)
    why = r.describe()

    [death] = by_event(ev, "exit", process=1)
    assert death["signal"] == "SIGKILL", death
    # Precondition: process 1 had joined before it was killed (else 0 and 2 could never
    # finish initializing: the service waits for all three to register).
    assert [e for e in by_event(ev, "worker_start", process=1) if e["time"] < death["time"]], (
        "process 1 was killed before it started (machine too slow for the after= trigger)\n" + why)
    shrunk = [e for e in by_event(ev, "allreduce") if e["members"] == [0, 2]]
    assert {e["process"] for e in shrunk} == {0, 2}, why
    assert all(e["time"] > death["time"] - 1 for e in shrunk)
    assert all(e["value"] == 4.0 for e in shrunk), shrunk  # (0 + 1) + (2 + 1)
    # Process 1 logged nothing after it was killed.
    assert not [e for e in ev if e["process"] == 1 and e.get("source") != "launcher"
                and e["time"] > death["time"]]
    for p in (0, 2):
        assert by_event(ev, "worker_done", process=p), f"process {p} did not finish\n{why}"
        [end] = by_event(ev, "exit", process=p)
        assert end.get("code") == 0, end
    # They all-reduced as three before the kill.
    assert [e for e in by_event(ev, "allreduce") if e["members"] == [0, 1, 2]], why

    s = summary(run_dir)
    assert s["restarts"] == {"0": 0, "1": 0, "2": 0}
    assert s["exit_code"] == 1
    assert s["final_returncodes"] == {"0": 0, "1": -9, "2": 0}

"""Rejoin: restarted processes are rehydrated from a live peer; training returns to full width."""

import pytest
from helpers import EXACT, MLP, REPO, commits_by_step, finals, new_function, train
from helpers import by_event as of

STEPS = 40
# These scenarios kill joiners as they join and restart processes every few steps of a
# 40-step run: timed for connect admission, where a restart is a member as soon as it
# connects. Ready admission (the default) lets the others train on while it sets up, and a
# short run can end first; its rejoins are tested in test_admission.py.
CONNECT = ("--admission", "connect")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    proc, events = train(tmp_path_factory.mktemp("ref"), MLP, "--steps", str(STEPS), *EXACT, n=1)
    assert proc.returncode == 0, proc.describe()
    return finals(events)[0]


def check_run(events, reference, restarts, n=3, why=""):
    f = finals(events)
    assert sorted(e["process"] for e in f) == list(range(n))
    assert len({e["params_sha256"] for e in f}) == 1, "members must end bitwise identical"
    assert all(e["step"] == STEPS for e in f)
    assert f[0]["params_sha256"] == reference["params_sha256"], "the fault-free run's params, to the bit"
    by_step = commits_by_step(events)
    assert sorted(by_step) == list(range(STEPS))
    for step, commits in by_step.items():
        procs = [c["process"] for c in commits]
        assert len(procs) == len(set(procs)), f"step {step} committed twice by one process"
        assert len({tuple(c["members"]) for c in commits}) == 1
        assert len({c["generation"] for c in commits}) == 1, f"step {step}: generations disagree"
    assert by_step[STEPS - 1][0]["members"] == list(range(n)), "back to full width"
    joins, rehydrated = of(events, "join"), of(events, "rehydrated")
    assert len(joins) == len(rehydrated) == restarts, why
    for r in rehydrated:
        assert r["bytes"] > 0 and r["donor"] != r["process"] and r["seconds"] >= 0
        donor_commits = [c for c in by_step[r["step"] - 1] if c["process"] == r["donor"]]
        assert donor_commits, "the donor must hold the latest committed step"


@pytest.mark.soak  # time budget: process 0's restart and rejoin is in test_survival.py, many restarts in the soak
def test_three_restarts_including_process_0(reference, tmp_path):
    faults = ["kill:process=0:step=5", "kill:process=1:step=12", "kill:process=0:step=20"]
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), *EXACT, *CONNECT, faults=faults, restart="on-failure")
    assert proc.returncode == 0, proc.describe()
    check_run(events, reference, restarts=3)
    assert {(r["process"], r["incarnation"]) for r in of(events, "rehydrated")} == {(0, 1), (1, 1), (0, 2)}


def test_two_join_at_once_and_one_dies_as_they_join(reference, tmp_path):
    """Right after the rejoin, process 3 dies before step 6. The survivors' first attempt at
    step 6 fails inside a gloo all-reduce; retrying on the same cached communicators used to
    read the aborted all-reduce's leftover bytes ("EnforceNotMet ... Received data size
    doesn't match expected size", SIGABRT, 2 of 7 runs). ElasticGroup now rebuilds the CPU
    data plane after every failed step, and a member whose collective fails breaks the
    others' out of it at once (jaxft.worker.breaker). This test, 20 runs in a loop (connect
    admission, exact reduction): 20 passed, 26-37 s each, no abort."""
    faults = ["kill:process=1:step=5", "kill:process=2:step=5",  # two joiners at once
              "kill:process=3:step=6:phase=before-step",  # dies in the step right after they join
              "kill:process=0:step=12:phase=after-commit"]
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), *EXACT, *CONNECT, n=4, faults=faults,
                         restart="on-failure")
    assert proc.returncode == 0, proc.describe()
    check_run(events, reference, restarts=4, n=4, why=proc.describe())
    # both joiners were rehydrated (at step 5 when they connect together; a slow restart joins later)
    assert {1, 2} <= {r["process"] for r in of(events, "rehydrated", incarnation=1)}, proc.describe()


@pytest.mark.soak  # long: the default suite stays under its time budget
def test_slow_restart_rejoins_behind(reference, tmp_path):
    # The survivors train on without process 2 for a while; it must catch up from a donor.
    # Margins, not luck: the restart waits 12 s (the survivors notice the death within
    # ~3-5 s and then commit a step per ~0.6 s), and the 34 remaining steps take >= 20 s,
    # so process 2 comes back behind the survivors and before they finish.
    faults = ["kill:process=2:step=6:phase=before-step"]
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), *EXACT, *CONNECT, "--step_sleep", "0.6", faults=faults,
                          restart="on-failure", extra=["--restart-delay", "12"])
    assert proc.returncode == 0, proc.describe()
    check_run(events, reference, restarts=1)
    (r,) = of(events, "rehydrated")
    assert r["step"] > 6, "process 2 should have come back after the survivors moved on"
    assert any(c["members"] == [0, 1] for c in of(events, "commit"))


@pytest.mark.soak
def test_ten_kill_restart_cycles(reference, tmp_path):
    faults = [f"kill:process=2:step={s}" for s in range(3, 33, 3)]
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), *EXACT, *CONNECT, faults=faults, restart="on-failure",
                          extra=["--max-restarts", "20"], timeout=600)
    assert proc.returncode == 0, proc.describe()
    check_run(events, reference, restarts=10)


def test_a_backend_a_rebuild_replaced_is_freed_at_its_next_commit(tmp_path):
    """A CPU backend a rebuild replaced is kept alive only by reference cycles (its client and
    its devices refer to each other), and with it its gloo communicators: one whose peer died
    can spin its event loop on a whole core. With Python's automatic collection off
    (``--no_gc``), only jaxft's collection after the rebuild's commit frees it
    (``jaxft.worker.dataplane``): those of the cold start's rebuild and of two admissions, each
    with a rehydration (whose broadcast programs held the mesh of the backend the next rebuild
    replaced, ``jaxft.worker.transfer.forget_programs``)."""
    runs = str(REPO / "tests" / "workers" / "mlp_runs.py")
    r, evts = train(tmp_path, runs, "--runs", "120", "--no_gc", "--step_sleep", "0.08", n=3,
                    faults=["kill:process=2:step=8", "kill:process=1:step=60"], restart="on-failure", timeout=180)
    assert r.returncode == 0, r.describe()
    assert of(evts, "rehydrated", process=2) and of(evts, "rehydrated", process=1), r.describe()
    f = finals(evts)
    assert sorted((x["process"], x["step"]) for x in f) == [(0, 120), (1, 120), (2, 120)], f
    assert [x["replaced_backends_alive"] for x in f] == [0, 0, 0], f


def test_a_state_whose_static_data_holds_functions_has_one_signature_in_every_process():
    # A flax TrainState keeps apply_fn and tx as static data, whose text in the treedef named
    # each function's address: every process held "another model", and a cold start of three
    # refused two of them (StateMismatch; examples/flax_trainstate.py). Two closures of one
    # function: other addresses, one signature; another function or another leaf still differs.
    import jax
    import numpy as np

    from jaxft.worker.rejoin import Signature

    def state(fn, shape=(3,)):
        return {"fn": jax.tree_util.Partial(fn), "w": np.zeros(shape, np.float32)}

    a, b = new_function(), new_function()
    assert a is not b and "0x" in str(jax.tree_util.tree_structure(state(a)))
    assert Signature.of(state(a)).digest == Signature.of(state(b)).digest
    assert Signature.of(state(a)).digest != Signature.of(state(np.tanh)).digest
    assert Signature.of(state(a)).digest != Signature.of(state(a, (4,))).digest

"""The atomic elastic step: survivors finish with the same math as a fault-free run.

Real processes, a real coordination service, real SIGKILL at named phases.
"""

import numpy as np
import pytest
from helpers import EXACT, MLP, commits_by_step, finals, train
from helpers import by_event as of

STEPS = 30
# The exact reduction makes a step's result independent of how many devices ran it, so a
# run with failures must end with the fault-free run's params_sha256, to the bit.


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    proc, events = train(d, MLP, "--steps", str(STEPS), *EXACT, "--final_params", str(d / "final"))
    assert proc.returncode == 0, proc.describe()
    f = finals(events)
    assert len(f) == 3 and len({e["params_sha256"] for e in f}) == 1
    return dict(f[0], final_params=str(d / "final" / "final-p0.npz"))


def test_fault_free_members_agree(reference, tmp_path):
    # the same model in one process computes the same parameters, to the bit
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), *EXACT, n=1)
    assert proc.returncode == 0, proc.describe()
    assert finals(events)[0]["params_sha256"] == reference["params_sha256"]


@pytest.mark.parametrize("phase", ["after-grad", pytest.param("before-step", marks=pytest.mark.soak),
                                   pytest.param("after-commit", marks=pytest.mark.soak)])
def test_survivor_finishes_with_same_result(reference, tmp_path, phase):
    faults = [f"kill:process=0:step=8:phase={phase}", f"kill:process=2:step=15:phase={phase}"]
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), *EXACT, faults=faults)
    assert proc.returncode == 1, proc.describe()  # two workers died and were not restarted
    by_step = commits_by_step(events)
    survivor = [e for e in of(events, "commit") if e["process"] == 1]
    assert [e["step"] for e in survivor] == list(range(STEPS)), "each step committed exactly once"
    for step, commits in by_step.items():
        assert len({tuple(c["members"]) for c in commits}) == 1, f"step {step}: members disagree"
        assert len({c["process"] for c in commits}) == len(commits)
    assert by_step[STEPS - 1][0]["members"] == [1]
    assert of(events, "step_failed", process=1), "the kills must have failed at least one step"
    (final,) = finals(events)
    assert final["step"] == STEPS
    assert final["params_sha256"] == reference["params_sha256"], "3, 2 then 1 devices: the same bits"


@pytest.mark.soak  # long: the default suite stays under its time budget
def test_micro_batches_match_full_batch(reference, tmp_path):
    # accumulation sums in another order: equal up to float32 rounding, leaf by leaf
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), "--micro_batch", "8", "--final_params",
                         str(tmp_path / "final"), n=3)
    assert proc.returncode == 0, proc.describe()
    with np.load(tmp_path / "final" / "final-p0.npz") as got, np.load(reference["final_params"]) as want:
        assert sorted(got.files) == sorted(want.files)
        for k in want.files:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_consistency_guard_names_the_diverged_process(tmp_path):
    proc, events = train(tmp_path, "tests/workers/diverge.py")
    assert proc.returncode != 0
    errors = of(events, "consistency_error")
    assert {e["process"] for e in errors} == {0, 1, 2}, proc.describe()
    assert all(e["processes"] == [1] and e["step"] == 5 for e in errors)
    assert not of(events, "commit", step=4), "the step that found the mismatch must not commit"

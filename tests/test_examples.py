"""The examples run under jaxft launch with faults, and jaxft report reads what they left."""

import json

import numpy as np
import pytest
from helpers import PYTHON, REPO, by_event, finals, run, run_jaxft, train

EXAMPLES = REPO / "examples"


def test_guide_survive_keeps_training_on_survivors(tmp_path):
    proc, ev = train(tmp_path, str(EXAMPLES / "guide_survive.py"), "--steps", "20",
                     faults=["kill:process=2:step=8"])
    assert proc.returncode == 1, proc.describe()  # process 2 died and stayed dead
    steps = [e["step"] for e in by_event(ev, "commit", process=0)]
    assert steps == list(range(20)), steps
    assert by_event(ev, "commit", process=0, step=19)[0]["members"] == [0, 1]


def test_guide_recover_and_report(tmp_path):
    # The example uses ready admission (ElasticTrainer's default): the survivors train on while
    # the restart waits out the heartbeat timeout (3 s + 1.5 s, see initialize's
    # wait_until_forgotten), starts and compiles, ~6 s in all here; their 17 steps after the
    # kill take >= 12 s, so it rejoins before the end (with 0.3 s it did not: 2 finals).
    proc, ev = train(tmp_path, str(EXAMPLES / "guide_recover.py"), "--steps", "20", "--step_sleep", "0.7",
                     faults=["kill:process=0:step=2"], restart="on-failure")
    assert proc.returncode == 0, proc.describe()
    f = finals(ev)
    assert len(f) == 3 and len({e["params_sha256"] for e in f}) == 1
    assert by_event(ev, "rehydrated", process=0, incarnation=1)

    png = tmp_path / "r.png"
    r = run_jaxft("report", str(tmp_path), "--json", "--png", str(png), timeout=60)
    assert r.returncode == 0, r.describe()
    s = json.loads(r.stdout)
    assert s["steps_committed"] == 20 and s["rejoins"] == 1 and s["faults_injected"] == 1
    assert s["incidents"] == 1 and s["mean_recovery_s"] > 0 and len(s["final_sha256"]) == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


@pytest.mark.soak  # long: the default suite stays under its time budget
def test_flax_digits_with_a_kill(tmp_path):
    # ready admission (the example's default): the 15 steps after the kill take >= 12 s, time
    # for the restart to wait out the heartbeat timeout, set up and be admitted
    proc, ev = train(tmp_path, str(EXAMPLES / "flax_digits.py"), "--steps", "20", "--global_batch", "64",
                     "--step_sleep", "0.8", n=2, faults=["kill:process=1:step=5"], restart="on-failure")
    assert proc.returncode == 0, proc.describe()
    f = finals(ev)
    assert len(f) == 2 and len({e["params_sha256"] for e in f}) == 1
    assert all(e["test_accuracy"] > 0.3 for e in by_event(ev, "eval"))  # 12 steps from 10% chance


# -- bring your own step (flax TrainState) and the Grain source: a kill changes nothing -------------

def _kill_vs_fault_free(tmp_path, example: str, steps: str = "30"):
    """Single process, then 3 processes with process 1 killed at step 8 (restarted, rejoins),
    then 3 processes without faults. All members of a run end bitwise identical; the two runs
    agree leaf by leaf up to float32 summation order (the survivors trained on 2 devices while
    process 1 set up; these examples use the default all-reduce, not the exact reduction).
    The sleep after each commit leaves the restarted process time to rejoin before the end."""
    single = run([PYTHON, str(EXAMPLES / example), "--steps", "6"], timeout=180)
    assert single.returncode == 0 and "done: step 6" in single.stdout, single.describe()
    proc, ev = train(tmp_path / "kill", str(EXAMPLES / example), "--steps", steps, "--step_sleep", "0.6",
                     "--final_params", str(tmp_path / "kill" / "final"), faults=["kill:process=1:step=8"],
                     restart="on-failure")
    assert proc.returncode == 0, proc.describe()
    assert by_event(ev, "fault", process=1) and by_event(ev, "rehydrated", process=1, incarnation=1)
    clean, ev_clean = train(tmp_path / "clean", str(EXAMPLES / example), "--steps", steps, "--final_params",
                            str(tmp_path / "clean" / "final"))
    assert clean.returncode == 0, clean.describe()
    shas = {e["process"]: e["params_sha256"] for e in finals(ev)}
    clean_shas = {e["process"]: e["params_sha256"] for e in finals(ev_clean)}
    assert sorted(shas) == sorted(clean_shas) == [0, 1, 2], (shas, clean_shas)
    assert len(set(shas.values())) == 1 and len(set(clean_shas.values())) == 1, (shas, clean_shas)
    with np.load(tmp_path / "kill" / "final" / "final-p1.npz") as got, \
            np.load(tmp_path / "clean" / "final" / "final-p0.npz") as want:
        assert sorted(got.files) == sorted(want.files) and want.files
        for k in want.files:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_flax_trainstate_trains_on_every_process(tmp_path):
    # Its TrainState keeps functions as static data (apply_fn, tx), whose addresses differ from
    # process to process: every process but 0 was refused as holding another model
    # (StateMismatch) until the state's signature left the addresses out.
    proc, ev = train(tmp_path, str(EXAMPLES / "flax_trainstate.py"), "--steps", "6", n=2)
    assert proc.returncode == 0, proc.describe()
    f = finals(ev)
    assert sorted(e["process"] for e in f) == [0, 1] and len({e["params_sha256"] for e in f}) == 1, f
    assert all(e["members"] == [0, 1] for e in by_event(ev, "commit")), "both trained every step"


@pytest.mark.soak  # long: the default suite stays under its time budget
def test_flax_trainstate_own_step_survives_a_kill(tmp_path):
    _kill_vs_fault_free(tmp_path, "flax_trainstate.py")


@pytest.mark.soak  # long: the default suite stays under its time budget
def test_grain_source_survives_a_kill(tmp_path):
    _kill_vs_fault_free(tmp_path, "grain_mlp.py")

"""Defects found by reading the code (reliability issue), each with a test that failed before.

Real processes; single-process cases run in a fresh interpreter.
"""

import json

import numpy as np
import pytest
from helpers import MLP, PYTHON, by_event, events, launch, run_python, summary

ALL_REJECTED = r"""
import glob, json, os, sys
import numpy as np
from jaxft.worker.checkpoint import CheckpointStore
from jaxft.errors import CheckpointError
root = sys.argv[1]
store = CheckpointStore(os.path.join(root, "ck"), keep=3, process_id=0)
tree = {"w": np.arange(1000, dtype=np.float32)}
assert store.save(5, tree).wait(60)
for f in glob.glob(os.path.join(root, "ck", "5", "**", "d", "*"), recursive=True):
    if os.path.isfile(f):
        data = bytearray(open(f, "rb").read()); data[len(data) // 2] ^= 0x5A; open(f, "wb").write(data)
try:
    store.restore_latest(tree)
    print(json.dumps({"raised": None}))
except CheckpointError as e:
    print(json.dumps({"raised": type(e).__name__, "message": str(e)}))
"""


def test_restore_that_rejects_every_checkpoint_raises(tmp_path):
    """Before: restore_latest returned None and training silently started from step 0."""
    r = run_python(ALL_REJECTED, str(tmp_path), timeout=90)
    assert r.returncode == 0, r.describe()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["raised"] == "CheckpointError", out
    assert "every checkpoint in" in out["message"] and "5:" in out["message"], out
    assert "refusing to start over from step 0" in out["message"], out


def test_checkpoint_dir_that_is_a_file_is_a_one_line_configuration_error(tmp_path):
    """Before: a FileExistsError traceback, repeated by every restart."""
    not_a_dir = tmp_path / "ckpt"
    not_a_dir.write_text("a file")
    r = launch(2, [PYTHON, MLP, "--steps", "3", "--checkpoint_every", "1", "--checkpoint_dir", str(not_a_dir)],
               "--restart", "on-failure", run_dir=tmp_path / "run", timeout=120)
    assert r.returncode == 1, r.describe()
    assert "Traceback" not in r.stdout + r.stderr, r.describe()
    assert f"checkpoint directory {not_a_dir} exists and is not a directory" in r.stdout, r.describe()
    assert summary(tmp_path / "run")["restarts"] == {"0": 0, "1": 0}


def test_padding_never_feeds_zeros_to_the_loss(tmp_path):
    """10 examples on 3 processes need 2 padding slots. Before, they were zeros: a loss that is
    NaN on zeros turned the whole gradient into NaN (NaN x 0 = NaN)."""
    worker = [PYTHON, "tests/workers/padding.py"]
    r = launch(3, worker, run_dir=tmp_path / "three", timeout=120)
    assert r.returncode == 0, r.describe()
    r1 = launch(1, worker, run_dir=tmp_path / "one", timeout=120)  # no padding at width 1
    assert r1.returncode == 0, r1.describe()
    three = by_event(events(tmp_path / "three"), "padding_result")
    (one,) = by_event(events(tmp_path / "one"), "padding_result")
    assert len(three) == 3 and all(e["finite"] for e in three), three
    for e in three:  # the same math at another width: equal up to float32 summation order
        np.testing.assert_allclose(e["w"], one["w"], rtol=1e-5, atol=1e-7)


def test_a_loss_of_the_wrong_shape_is_refused(tmp_path):
    """Before, a [B, 1] loss broadcast against the [B] mask into [B, B] and trained wrongly."""
    r = launch(1, [PYTHON, "tests/workers/padding.py", "--bad_shape"], run_dir=tmp_path, timeout=120)
    assert r.returncode != 0, r.describe()
    assert "loss_fn must return one loss per example, shape (10,); it returned shape (10, 1)" in r.stdout, \
        r.describe()


def test_consistency_tie_blames_the_same_process_everywhere():
    """Before, a 1-1 tie was broken by set order, so members could blame different processes."""
    from jaxft.worker.transfer import disagreeing

    assert disagreeing([0, 1], [b"a", b"b"]) == [1]
    assert disagreeing([0, 1], [b"b", b"a"]) == [1]  # whatever the keys' order: the lowest id's key wins a tie
    assert disagreeing([3, 1, 2, 0], [b"x", b"y", b"x", b"y"]) == [2, 3]
    assert disagreeing([0, 1, 2], [b"a", b"b", b"b"]) == [0]  # a real majority still wins


def test_a_second_run_in_the_same_job_is_not_cut_short(tmp_path):
    """Before, the first run's finished flag made a process waiting > 0.5 s at a barrier of the
    second run exit 0, as if the job were over."""
    r = launch(2, [PYTHON, "tests/workers/two_runs.py"], run_dir=tmp_path, timeout=120)
    assert r.returncode == 0, r.describe()
    finals = by_event(events(tmp_path), "final")
    assert sorted((f["process"], f["step"]) for f in finals) == [(0, 4), (0, 8), (1, 4), (1, 8)], finals


def test_min_members_waits_instead_of_training_alone(tmp_path):
    # Process 1 is away >= 3 s (then it waits out the heartbeat timeout before it connects):
    # process 0 sees itself alone. With ready admission (ElasticTrainer's default) the joiner
    # enters on the waiting member's votes: no step commits to carry them, and before, each
    # waited for the other until Timeouts.barrier ended the run.
    r = launch(2, [PYTHON, "tests/workers/two_runs.py", "--min_members", "2", "--steps", "12"],
               "--restart", "on-failure", "--restart-delay", "3", "--heartbeat-timeout", "3",
               "--fault", "kill:process=1:step=4", run_dir=tmp_path, timeout=180)
    assert r.returncode == 0, r.describe()
    ev = events(tmp_path)
    assert {tuple(e["members"]) for e in by_event(ev, "commit")} == {(0, 1)}, "a step committed with one member"
    assert by_event(ev, "step_waiting", process=0), "process 0 should have waited for process 1"
    (admit,) = by_event(ev, "admit", process=0)
    assert admit["joiners"] == [1] and admit["step"] == 4, admit  # admitted while waiting at step 4
    assert by_event(ev, "rehydrated", process=1, incarnation=1)
    finals = by_event(ev, "final")
    assert len({f["params_sha256"] for f in finals}) == 1 and {f["step"] for f in finals} == {12}


@pytest.mark.soak  # long: the default suite stays under its time budget
def test_a_process_back_after_the_run_finished_does_not_train_alone(tmp_path):
    """Before, a worker restarted after its peers had finished found itself the only member
    and trained the whole run again on its own, from step 0."""
    r = launch(2, [PYTHON, MLP, "--steps", "6", "--hidden", "8"], "--restart", "on-failure",
               "--restart-delay", "8", "--fault", "kill:process=1:step=2", run_dir=tmp_path, timeout=120)
    assert r.returncode == 0, r.describe()
    ev = events(tmp_path)
    assert by_event(ev, "launch", process=1, incarnation=1), "process 1 came back"
    assert not by_event(ev, "commit", process=1, incarnation=1), "it committed steps alone after the run ended"
    assert by_event(ev, "run_already_finished", process=1, incarnation=1)

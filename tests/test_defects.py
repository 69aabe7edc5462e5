"""Defects found by reading the code (reliability issue), each with a test that failed before.

Real processes; single-process cases run in a fresh interpreter.
"""

import json
import os

import numpy as np
import pytest

from helpers import MLP, PYTHON, by_event, events, launch, run_python, summary


ALL_REJECTED = r"""
import glob, json, os, sys
import numpy as np
from jaxft.checkpoint import CheckpointStore
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

"""The standby worker (``jaxft launch --standby``, on by default): a restart becomes an interpreter
started ahead with its imports done (jaxft.standby). Real launches, real processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import JAXFT, PYTHON, REPO, by_event, clean_env, events, launch, run

from jaxft.standby import Target, target_of

PROBE = REPO / "tests" / "workers" / "standby_probe.py"


@pytest.mark.parametrize(("command", "expected"), [
    (["python3", "-m", "pkg.mod", "--steps", "5"], Target("python3", "pkg.mod", None, ("--steps", "5"))),
    (["/v/bin/python", "-u", "train.py", "a"], Target("/v/bin/python", None, "train.py", ("a",))),
    (["python", "-m"], None),  # (no module)
    (["python", "-c", "print(1)"], None),  # code on the command line: nothing to run ahead
    (["python", "-X", "dev", "train.py"], None),  # an option a standby would not honour
    (["bash", "run.sh"], None),
    ([], None),
])
def test_only_a_python_module_or_script_is_served(command, expected):
    assert target_of(command) == expected


def _probe_run(tmp_path: Path, command: list[str], *options: str, env: dict | None = None):
    run_dir, out = tmp_path / "run", tmp_path / "found.json"
    result = launch(2, [*command, str(out)], "--restart", "on-failure", *options, run_dir=run_dir, timeout=60,
                    env=env)
    return result, events(run_dir), out


@pytest.mark.parametrize("form", ["script", "module"])
def test_a_restart_becomes_the_standby_with_its_own_life(tmp_path, form):
    """Life 0 crashes; its restart is the standby (the pid the launcher watches): it runs the
    worker's script or module as ``__main__`` with the restart's environment, jax already
    imported, its stdin at its end; and no standby outlives the run."""
    env = clean_env(PYTHONPATH=os.pathsep.join([str(PROBE.parent), os.environ.get("PYTHONPATH", "")]))
    command = [PYTHON, str(PROBE)] if form == "script" else [PYTHON, "-m", "standby_probe"]
    result, evts, out = _probe_run(tmp_path, command, env=env)
    assert result.returncode == 0, result.describe()
    [first, restart] = by_event(evts, "launch", process=0)
    assert "standby" not in first and restart["standby"] is True, (first, restart)
    found = json.loads(out.read_text())
    assert found["pid"] == restart["pid"], (found, restart)
    assert found["name"] == "__main__" and found["jax_before"] and found["stdin_at_end"], found
    assert Path(found["argv"][0]).name in ("standby_probe.py",) and found["argv"][1:] == [str(out)], found
    env_seen = found["env"]
    assert (env_seen["JAXFT_PROCESS_ID"], env_seen["JAXFT_INCARNATION"]) == ("0", "1"), env_seen
    assert env_seen["JAXFT_PREVIOUS_DIED_AT"] and float(env_seen["JAXFT_LIFE_STARTED"]) >= restart["time"] - 1, found
    left = subprocess.run(["pgrep", "-f", f"jaxft.standby.*{out}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"a standby outlived the run: {left.stdout}"


def test_without_standby_a_restart_is_a_fresh_interpreter(tmp_path):
    result, evts, out = _probe_run(tmp_path, [PYTHON, str(PROBE)], "--no-standby", env=clean_env(PROBE_HOLD_S="0"))
    assert result.returncode == 0, result.describe()
    assert not [e for e in by_event(evts, "launch") if e.get("standby")]
    found = json.loads(out.read_text())
    assert not found["jax_before"] and found["env"]["JAXFT_LIFE_STARTED"] is None, found


def test_a_standby_that_cannot_start_leaves_restarts_as_they_were(tmp_path):
    """The workers' interpreter cannot import jaxft (the probe needs nothing of it): the standby
    exits as it starts; the restart starts a fresh interpreter and the launcher says why."""
    bare = Path(sys.base_prefix) / "bin" / "python3"
    env = {k: v for k, v in clean_env(PROBE_HOLD_S="3").items() if k != "PYTHONPATH"}
    if not bare.exists() or subprocess.run([str(bare), "-c", "import jaxft"], capture_output=True, env=env,
                                           cwd=tmp_path).returncode == 0:
        pytest.skip(f"needs an interpreter without jaxft ({bare})")
    run_dir, out = tmp_path / "run", tmp_path / "found.json"
    result = run([*JAXFT, "launch", "-n", "2", "--restart", "on-failure", "--console", "raw", "--run-dir",
                  str(run_dir), "--", str(bare), str(PROBE), str(out)], timeout=60, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.describe()
    assert not [e for e in by_event(events(run_dir), "launch") if e.get("standby")], result.describe()
    assert "the standby worker exited" in result.stdout + result.stderr, result.describe()
    assert json.loads(out.read_text())["env"]["JAXFT_INCARNATION"] == "1"

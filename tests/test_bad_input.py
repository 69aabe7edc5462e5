"""Every CLI flag's bad values, and initialize()'s: one line, a non-zero exit, no traceback,
in well under 10 s. Real processes."""

import json

import pytest
from helpers import PYTHON, clean_env, run_jaxft, run_python

pytestmark = pytest.mark.smoke

OK = ["--", PYTHON, "-c", "pass"]
LAUNCH = [
    (["-n", "x"], "argument -n/--num-processes/--nproc-per-node: invalid int value: 'x'"),
    (["-n", "0"], "-n must be >= 1, got 0"),
    (["--nnodes", "0", "-n", "1"], "--nnodes must be >= 1, got 0"),
    (["--nnodes", "2", "-n", "1"], "--nnodes > 1 needs --coordinator"),
    (["--node-rank", "-1", "-n", "1"], "--node-rank must be in [0, 1), got -1"),
    (["--coordinator", "nohost", "-n", "1"], "--coordinator must be HOST:PORT"),
    (["--coordinator", "h:99999", "-n", "1"], "--coordinator must be HOST:PORT"),
    (["--host-coordinator", "-n", "1"], "--host-coordinator needs --coordinator"),
    (["--restart", "sometimes", "-n", "1"], "argument --restart: invalid choice: 'sometimes'"),
    (["--restart-delay", "-1", "-n", "1"], "--restart-delay must be >= 0"),
    (["--restart-delay", "soon", "-n", "1"], "argument --restart-delay: invalid float value: 'soon'"),
    (["--max-restarts", "-2", "-n", "1"], "--max-restarts must be >= 0"),
    (["--fault", "explode:process=0:step=1", "-n", "1"], "unknown action 'explode'"),
    (["--fault", "kill:process=5:step=1", "-n", "1"], "process 5 does not exist"),
    (["--run-dir", "/proc/jaxft-nope", "-n", "1"], "--run-dir '/proc/jaxft-nope': cannot create it"),
    (["--heartbeat-timeout", "0", "-n", "1"], "--heartbeat-timeout and --collective-timeout must be >= 1"),
    (["--collective-timeout", "abc", "-n", "1"], "argument --collective-timeout: invalid int value: 'abc'"),
    (["--timeout", "nope=1", "-n", "1"], "unknown timeout(s) ['nope']"),
    (["--timeout", "reset", "-n", "1"], "is not NAME=SECONDS"),
    (["--port", "99999", "-n", "1"], "--port must be in 0..65535"),
    (["--gpus", "one", "-n", "1"], "--gpus takes auto, all, none or a list like 0,1,2"),
    (["--gpus", "0,1", "-n", "3"], "-n 3 workers but this node has 2 GPU(s)"),
    (["--grace", "-1", "-n", "1"], "--grace must be >= 0"),
    (["--gloo-interface", "nonexistent0", "-n", "1"], "--gloo-interface: network interface 'nonexistent0' does not"),
    (["-n", "1", "--", "/no/such/worker"], "worker command '/no/such/worker' not found"),
]


def _one_line_error(r, prefix: str, needle: str):
    assert r.returncode == 2, r.describe()
    assert r.elapsed < 10, r.describe()
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), r.describe()
    assert needle in lines[0], r.describe()
    assert "Traceback" not in r.stdout + r.stderr, r.describe()


@pytest.mark.parametrize("args, needle", LAUNCH, ids=[" ".join(a) for a, _ in LAUNCH])
def test_launch_flags(args, needle):
    tail = [] if "--" in args else OK
    r = run_jaxft("launch", "--gpus" if "--gpus" not in args else "--grace", "none" if "--gpus" not in args else "5",
                  *args, *tail, timeout=30)
    _one_line_error(r, "jaxft launch: error: ", needle)


COORDINATOR = [
    (["--port", "abc", "--num-processes", "2"], "argument --port: invalid int value: 'abc'"),
    (["--port", "99999", "--num-processes", "2"], "port 99999 is out of range"),
    (["--port", "0"], "the following arguments are required: --num-processes"),
    (["--port", "0", "--num-processes", "0"], "--num-processes must be >= 1, got 0"),
    (["--port", "0", "--num-processes", "2", "--heartbeat-timeout", "0"], "heartbeat timeout must be >= 1 s"),
    (["--port", "0", "--num-processes", "2", "--bind", "300.1.1.1"], "cannot bind 300.1.1.1"),
]


@pytest.mark.parametrize("args, needle", COORDINATOR, ids=[" ".join(a) for a, _ in COORDINATOR])
def test_coordinator_flags(args, needle):
    r = run_jaxft("coordinator", *args, timeout=30)
    _one_line_error(r, "jaxft coordinator: error: ", needle)


def test_report_and_unknown_command(tmp_path):
    r = run_jaxft("report", str(tmp_path / "missing"), timeout=30)
    assert r.returncode == 2 and r.stdout.strip().endswith("no events.jsonl in " + str(tmp_path / "missing")), \
        r.describe()
    r = run_jaxft("teleport", timeout=30)
    _one_line_error(r, "jaxft: error: ", "invalid choice: 'teleport'")


INITIALIZE = r"""
import json, jaxft
cases = {
    "negative_pid": dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=-1),
    "pid_out_of_range": dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=2),
    "zero_processes": dict(coordinator_address="127.0.0.1:1", num_processes=0, process_id=0),
    "missing_id": dict(coordinator_address="127.0.0.1:1", num_processes=2),
    "bad_env_number": dict(environ={"JAXFT_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAXFT_NUM_PROCESSES": "two",
                                    "JAXFT_PROCESS_ID": "0"}),
    "bad_timeouts_env": dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=1,
                             environ={"JAXFT_TIMEOUTS": "reset=soon"}),
    "zero_heartbeat": dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=1,
                           environ={"JAXFT_TIMEOUTS": "heartbeat=0"}),
    "bad_address": dict(coordinator_address="nohostport", num_processes=2, process_id=1,
                        timeouts=jaxft.Timeouts(initialization=1)),
}
out = {}
for name, kwargs in cases.items():
    kwargs.setdefault("environ", {})
    try:
        jaxft.initialize(**kwargs)
        out[name] = None
    except jaxft.InitializeError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


def test_initialize_arguments():
    r = run_python(INITIALIZE, timeout=60, env=clean_env())
    assert r.returncode == 0 and r.elapsed < 10, r.describe()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    expected = {
        "negative_pid": "process_id must be in [0, 2), got -1",
        "pid_out_of_range": "process_id must be in [0, 2), got 2",
        "zero_processes": "num_processes must be >= 1, got 0",
        "missing_id": "missing: process_id",
        "bad_env_number": "JAXFT_NUM_PROCESSES='two' is malformed",
        "bad_timeouts_env": "timeout reset='soon' is not a number",
        "zero_heartbeat": "timeout heartbeat must be >= 1 second",
        "bad_address": "'nohostport' is not host:port",
    }
    for name, needle in expected.items():
        assert out[name] is not None and needle in out[name], (name, out[name])
        assert "\n" not in out[name], (name, out[name])


def test_an_unsupported_orbax_is_refused_before_any_save():
    """A checkout run without installing gets no resolver's check: orbax-checkpoint 0.12.4 (a
    GPU machine's image) saved but failed every restore. The adapter refuses it on import, with
    the bound pyproject.toml declares."""
    import re
    from pathlib import Path

    from jaxft.errors import ConfigError, UnsupportedOrbax
    from jaxft.worker.checkpoint import orbax

    assert issubclass(UnsupportedOrbax, ConfigError)  # a worker stops on it (exit 78), not restarted
    for found in ("0.12.4", "0.13.0", "0.11.9"):
        with pytest.raises(UnsupportedOrbax, match=rf"orbax-checkpoint>=0\.12\.8,<0\.13, found {re.escape(found)}"):
            orbax.check_orbax_version(found)
    for found in ("0.12.8", "0.12.10"):
        orbax.check_orbax_version(found)
    orbax.check_orbax_version(orbax._installed_orbax())  # (the one this suite runs on)
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    low, high = (".".join(map(str, v)) for v in orbax.SUPPORTED_ORBAX)
    assert f'"orbax-checkpoint>={low},<{high}"' in pyproject, "SUPPORTED_ORBAX and pyproject.toml disagree"

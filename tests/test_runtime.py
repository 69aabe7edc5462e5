"""``jaxft.initialize``: flags, guards and a real one-process start, each in a fresh process."""

import json
import signal
import time

import pytest
from helpers import clean_env, free_port, run_python

from jaxft import protocol
from jaxft.worker import runtime
from jaxft.worker.runtime import (
    CPU_COLLECTIVE_TIMEOUT_FLAG,
    GPU_ENV,
    GPU_XLA_FLAGS,
    configure_environment,
    merge_xla_flags,
)

# -- XLA flags -----------------------------------------------------------------------------


@pytest.mark.smoke
def test_merge_xla_flags_adds_missing_and_keeps_user_values():
    assert merge_xla_flags("", {"a": "1"}) == "--a=1"
    assert merge_xla_flags(None, {"a": "1", "b": "x"}) == "--a=1 --b=x"
    merged = merge_xla_flags("--a=0 --user_only=7", {"a": "1", "c": "3"})
    assert merged.split() == ["--a=0", "--user_only=7", "--c=3"]  # the user's a=0 wins
    # A bare boolean flag counts as set.
    assert merge_xla_flags("--a", {"a": "false", "b": "1"}).split() == ["--a", "--b=1"]
    # Nothing to add: unchanged, including extra whitespace being normalised only.
    assert merge_xla_flags("--a=1  --b=2", {"a": "9", "b": "9"}).split() == ["--a=1", "--b=2"]


def test_merge_xla_flags_with_the_real_flags():
    wanted = dict(GPU_XLA_FLAGS, **{CPU_COLLECTIVE_TIMEOUT_FLAG: "5"})
    user = "--xla_gpu_nccl_terminate_on_error=true --xla_cpu_collective_timeout_seconds=42 --xla_dump_to=/tmp/d"
    tokens = merge_xla_flags(user, wanted).split()
    assert tokens[:3] == user.split()
    assert "--xla_gpu_nccl_terminate_on_error=false" not in tokens
    assert "--xla_cpu_collective_timeout_seconds=5" not in tokens
    assert "--xla_gpu_nccl_async_execution=true" in tokens
    assert "--xla_gpu_nccl_blocking_communicators=false" in tokens


def test_configure_environment_respects_user_env():
    environ = {"XLA_FLAGS": "--xla_gpu_nccl_async_execution=false",
               "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "0"}
    configure_environment(9, environ)
    flags = environ["XLA_FLAGS"].split()
    assert flags[0] == "--xla_gpu_nccl_async_execution=false"
    assert "--xla_gpu_nccl_async_execution=true" not in flags
    assert f"--{CPU_COLLECTIVE_TIMEOUT_FLAG}=9" in flags
    assert "--xla_gpu_nccl_terminate_on_error=false" in flags
    assert environ["XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"] == "0"  # the user's value stays
    assert environ["XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE"] == GPU_ENV[
        "XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE"]


# -- guards (each in a fresh interpreter: initialize touches process-global JAX state) -------

TRY_INITIALIZE = """
import json, sys, time
import jaxft
def attempt(**kwargs):
    t0 = time.monotonic()
    try:
        jaxft.initialize(**kwargs)
    except jaxft.InitializeError as e:
        return {"error": str(e), "type": type(e).__name__, "elapsed": time.monotonic() - t0}
    return {"error": None, "elapsed": time.monotonic() - t0}
"""


@pytest.mark.smoke
def test_initialize_after_backend_start_fails_and_says_call_it_first():
    code = TRY_INITIALIZE + """
import jax
jax.devices()  # starts the backend
print(json.dumps(attempt(coordinator_address="127.0.0.1:1", num_processes=1, process_id=0,
                         environ={})))
"""
    r = run_python(code, timeout=30)
    assert r.returncode == 0, r.describe()
    assert r.elapsed < 10, r.describe()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["type"] == "InitializeError", out
    assert "must run before JAX starts its backend" in out["error"]
    assert "Call jaxft.initialize() at the top of your program" in out["error"]


def test_initialize_rejects_bad_arguments():
    code = TRY_INITIALIZE + """
cases = {
    "pid_too_big": dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=2),
    "pid_negative": dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=-1),
    "zero_processes": dict(coordinator_address="127.0.0.1:1", num_processes=0, process_id=0),
    "missing": dict(num_processes=2),
    "bad_env": dict(coordinator_address="127.0.0.1:1", num_processes=2,
                    environ={"JAXFT_PROCESS_ID": "one"}),
    "bad_timeout": dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0,
                        environ={"JAXFT_TIMEOUTS": "heartbeat=-1"}),
    "bad_collective_timeout": dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0,
                                   environ={"JAXFT_TIMEOUTS": "collective=-5"}),
}
out = {}
for name, kwargs in cases.items():
    kwargs.setdefault("environ", {})
    out[name] = attempt(**kwargs)
from jax._src import distributed, xla_bridge
out["untouched"] = distributed.global_state.client is None and not xla_bridge.backends_are_initialized()
print(json.dumps(out))
"""
    r = run_python(code, timeout=30)
    assert r.returncode == 0, r.describe()
    assert r.elapsed < 10, r.describe()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["pid_too_big"]["error"] == "process_id must be in [0, 2), got 2"
    assert out["pid_negative"]["error"] == "process_id must be in [0, 2), got -1"
    assert out["zero_processes"]["error"] == "num_processes must be >= 1, got 0"
    assert "missing: coordinator_address, process_id" in out["missing"]["error"]
    assert "JAXFT_PROCESS_ID='one' is malformed" in out["bad_env"]["error"]
    assert "must be >= 1 second" in out["bad_timeout"]["error"]
    assert "must be >= 1 second" in out["bad_collective_timeout"]["error"]
    assert out["untouched"] is True  # a rejected call neither connected nor started a backend


def test_initialize_rejects_zero_timeouts():
    # Should the check be skipped, this connects to a service of its own and succeeds quickly.
    code = TRY_INITIALIZE + f"""
print(json.dumps(attempt(coordinator_address="127.0.0.1:{free_port()}", num_processes=1, process_id=0,
                         options=jaxft.InitOptions(external_coordinator=False),
                         environ={{"JAXFT_TIMEOUTS": "heartbeat=0"}})))
"""
    r = run_python(code, timeout=30)
    assert r.returncode == 0, r.describe()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "must be >= 1 second" in (out["error"] or ""), out


UNREACHABLE = TRY_INITIALIZE + """
import socket
with socket.socket() as s:  # a port nobody listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
print(json.dumps(attempt(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=1,
                         options=jaxft.InitOptions(external_coordinator=True),
                         timeouts=jaxft.Timeouts(initialization=3), environ={})))
"""


@pytest.fixture(scope="module")
def unreachable_attempt():
    """One initialize() against a port nobody listens on (shared: it takes ~10 s)."""
    return run_python(UNREACHABLE, timeout=40)


def test_initialize_unreachable_coordinator_does_not_hang(unreachable_attempt):
    """Whatever the failure mode, an unreachable coordinator ends the attempt quickly."""
    r = unreachable_attempt
    assert r.elapsed < 25, r.describe()
    if r.returncode == 0:
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["error"] is not None, r.describe()
    else:  # jaxlib's client aborts the process (jaxft probes first to avoid this)
        assert r.returncode == -signal.SIGABRT, r.describe()
        assert "DEADLINE_EXCEEDED" in r.stderr, r.describe()


def test_initialize_unreachable_coordinator_raises_initialize_error(unreachable_attempt):
    r = unreachable_attempt
    assert r.returncode == 0, r.describe()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["type"] == "InitializeError", out
    assert "127.0.0.1:" in out["error"], out
    assert out["elapsed"] < 6, out  # initialization_timeout=3, plus slack
    assert r.elapsed < 10, r.describe()


ONE_PROCESS = """
import json, os, sys
import jaxft
from jax._src import distributed, xla_bridge
external = sys.argv[1] == "external"
coord = jaxft.Coordinator(1) if external else None
address = coord.address if external else f"127.0.0.1:{int(sys.argv[2])}"
rt = jaxft.initialize(address, 1, 0, timeouts=jaxft.Timeouts(collective=7, initialization=20),
                      options=jaxft.InitOptions(external_coordinator=external, run_dir=sys.argv[3]))
import jax
out = {
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "env": {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE",
                                            "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT")},
    "recoverability": bool(jax.config.jax_enable_recoverability),
    "backend_started_by_initialize": bool(xla_bridge.backends_are_initialized()),
    "service_in_worker": distributed.global_state.service is not None,
    "runtime": {k: getattr(rt, k) for k in ("process_id", "num_processes", "incarnation",
                                              "coordinator_address", "external_coordinator",
                                              "collective_timeout", "heartbeat_timeout", "run_dir")},
}
try:
    jaxft.initialize(address, 1, 0, options=jaxft.InitOptions(external_coordinator=external))
except jaxft.InitializeError as e:
    out["second_call"] = str(e)
out["devices"] = [d.platform for d in jax.devices()]
out["process_count"] = jax.process_count()
out["sum"] = float(jax.numpy.arange(4.0).sum())
rt.events.log("hello", n=1)
print(json.dumps(out), flush=True)
jax.distributed.shutdown()
if coord is not None:
    coord.shutdown()
"""


@pytest.mark.smoke
def test_one_process_initialize_with_external_coordinator(tmp_path):
    env = clean_env(XLA_FLAGS="--xla_gpu_nccl_terminate_on_error=true")
    r = run_python(ONE_PROCESS, "external", "0", str(tmp_path / "run"), timeout=60, env=env)
    assert r.returncode == 0, r.describe()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    flags = out["xla_flags"].split()
    assert "--xla_gpu_nccl_terminate_on_error=true" in flags  # the user's flag won
    assert "--xla_gpu_nccl_terminate_on_error=false" not in flags
    assert "--xla_gpu_nccl_async_execution=true" in flags
    assert "--xla_gpu_nccl_blocking_communicators=false" in flags
    assert "--xla_cpu_collective_timeout_seconds=7" in flags
    assert out["env"] == GPU_ENV
    assert out["recoverability"] is True
    assert out["backend_started_by_initialize"] is False
    assert out["service_in_worker"] is False  # the worker did not host a second service
    rt = out["runtime"]
    assert rt["process_id"] == 0 and rt["num_processes"] == 1 and rt["incarnation"] == 0
    assert rt["external_coordinator"] is True and rt["collective_timeout"] == 7
    assert rt["run_dir"] == str(tmp_path / "run")
    assert "already initialized" in out["second_call"]
    assert out["devices"] == ["cpu"] and out["process_count"] == 1 and out["sum"] == 6.0
    from jaxft import read_events
    [hello] = [e for e in read_events(tmp_path / "run") if e["event"] == "hello"]
    assert hello["process"] == 0 and hello["incarnation"] == 0


def test_one_process_initialize_hosting_the_service(tmp_path):
    """external_coordinator=False: like plain jax.distributed, process 0 hosts the service."""
    r = run_python(ONE_PROCESS, "internal", str(free_port()), str(tmp_path / "run"), timeout=60)
    assert r.returncode == 0, r.describe()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["service_in_worker"] is True
    assert out["runtime"]["external_coordinator"] is False
    assert "--xla_cpu_collective_timeout_seconds=7" in out["xla_flags"].split()
    assert out["recoverability"] is True
    assert out["sum"] == 6.0


def test_initialize_reads_the_launcher_environment(tmp_path):
    code = """
import json, os
import jaxft
coord = jaxft.Coordinator(1)
os.environ.update({"JAXFT_COORDINATOR_ADDRESS": coord.address, "JAXFT_EXTERNAL_COORDINATOR": "1",
                   "JAXFT_PROCESS_ID": "0", "JAXFT_NUM_PROCESSES": "1", "JAXFT_INCARNATION": "3",
                   "JAXFT_HEARTBEAT_TIMEOUT": "4", "JAXFT_COLLECTIVE_TIMEOUT": "6"})
rt = jaxft.initialize(timeouts=jaxft.Timeouts.from_env().replace(initialization=20))
print(json.dumps({"pid": rt.process_id, "n": rt.num_processes, "inc": rt.incarnation,
                  "hb": rt.heartbeat_timeout, "ct": rt.collective_timeout,
                  "ext": rt.external_coordinator, "run_dir": rt.run_dir,
                  "flags": os.environ["XLA_FLAGS"]}), flush=True)
import jax
jax.distributed.shutdown()
coord.shutdown()
"""
    r = run_python(code, timeout=60, env=clean_env(JAXFT_RUN_DIR=str(tmp_path)))
    assert r.returncode == 0, r.describe()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"pid": 0, "n": 1, "inc": 3, "hb": 4, "ct": 6, "ext": True, "run_dir": str(tmp_path),
                   "flags": out["flags"]}
    assert "--xla_cpu_collective_timeout_seconds=6" in out["flags"].split()


def test_a_restart_connects_once_its_witnesses_dropped_its_previous_life(tmp_path, monkeypatch):
    """jaxft launch names the members alive at the death (one node): the restart waits for
    their marks, never less than RESTART_GAP_S after the death; without witnesses it waits
    out the heartbeat timeout + 1.5 s."""
    state = str(tmp_path)
    died_at = float(f"{time.time():.6f}")  # as the launcher passes it
    env = {protocol.DIED_AT: f"{died_at:.6f}", protocol.FAULT_STATE_DIR: state, protocol.DROP_WITNESSES: "0,2"}
    monkeypatch.setenv(protocol.FAULT_STATE_DIR, state)
    time.sleep(0.01)  # a mark comes after the death it answers (a death rounded up once hid them)
    for member in ("0", "2"):
        monkeypatch.setenv(protocol.PROCESS_ID, member)
        protocol.mark_dropped(1)
    runtime._wait_until_forgotten(env, 1.0, 1)
    waited = time.time() - died_at
    assert protocol.RESTART_GAP_S - 0.01 <= waited < 2.5, waited
    env[protocol.DIED_AT] = f"{time.time():.6f}"  # a new death: the marks above are older
    start = time.time()
    runtime._wait_until_forgotten(env, 1.0, 1)
    assert time.time() - start >= 2.4, "marks older than the death do not count"
    env.pop(protocol.DROP_WITNESSES)
    env[protocol.DIED_AT] = f"{time.time():.6f}"
    start = time.time()
    runtime._wait_until_forgotten(env, 1.0, 1)
    assert time.time() - start >= 2.4, "no witnesses: the heartbeat timeout + 1.5 s"


CACHE_DIR = r'''
import json, sys
import jax
from jaxft.worker import runtime
setting, run_dir, env = json.loads(sys.argv[1])
runtime._configure_compilation_cache(setting, run_dir, env)
print("CACHE", jax.config.jax_compilation_cache_dir)
'''


@pytest.mark.parametrize("setting,env,expected", [
    (None, {}, "RUN/xla_cache"),  # the run's own
    (None, {protocol.COMPILATION_CACHE: "SHARED"}, "SHARED"),  # one across runs
    (None, {protocol.COMPILATION_CACHE: ""}, "RUN/xla_cache"),  # empty: not set
    ("MINE", {protocol.COMPILATION_CACHE: "SHARED"}, "MINE"),  # the option wins
    (False, {protocol.COMPILATION_CACHE: "SHARED"}, "None"),  # off
    (None, {"JAX_COMPILATION_CACHE_DIR": "JAXS"}, "None"),  # the user's own jax setting: left alone
])
def test_the_compilation_cache_directory(tmp_path, setting, env, expected):
    def real(s):
        return str(tmp_path / s) if isinstance(s, str) and s and s != "None" else s

    env = {k: real(v) for k, v in env.items()}
    r = run_python(CACHE_DIR, json.dumps([real(setting), str(tmp_path / "RUN"), env]))
    assert r.returncode == 0, r.describe()
    assert f"CACHE {real(expected)}" in r.stdout, r.describe()

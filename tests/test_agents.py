"""`jaxft launch` as one node's agent of several, and its device assignment on GPU nodes.

The agents here share one machine (loopback); tests/test_multihost.py runs them on real
network hosts. GPU assignment is exercised with a fake `nvidia-smi` on PATH: no GPU needed.
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import JAXFT, MLP, PYTHON, REPO, by_event, clean_env, events, free_port, run_jaxft

pytestmark = pytest.mark.smoke

ENV_PRINTER = ("import json, os; print('ENV', json.dumps({k: os.environ.get(k) for k in "
               "('JAXFT_PROCESS_ID', 'JAXFT_NUM_PROCESSES', 'JAXFT_LOCAL_DEVICE_IDS', 'JAXFT_COORDINATOR_ADDRESS', "
               "'JAXFT_GLOO_INTERFACE', 'JAX_PLATFORMS')}), flush=True)")


def _fake_gpus(tmp_path: Path, count: int) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    lines = "".join(f'echo "GPU {i}: NVIDIA H200 (UUID: GPU-fake-{i})"\n' for i in range(count))
    script.write_text(f"#!/bin/sh\n{lines}")
    script.chmod(0o755)
    env = clean_env()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    del env["JAX_PLATFORMS"]  # as on a GPU node: JAX_PLATFORMS=cpu would make CPU workers
    return env


def _envs(stdout: str) -> list[dict]:
    return sorted((json.loads(line.split("ENV ", 1)[1]) for line in stdout.splitlines() if "ENV {" in line),
                  key=lambda e: int(e["JAXFT_PROCESS_ID"]))


def test_one_worker_per_gpu_by_default(tmp_path):
    env = _fake_gpus(tmp_path, 3)
    r = run_jaxft("launch", "--console", "raw", "--", PYTHON, "-c", ENV_PRINTER, env=env, timeout=60)
    assert r.returncode == 0, r.describe()
    envs = _envs(r.stdout)
    assert [(e["JAXFT_PROCESS_ID"], e["JAXFT_LOCAL_DEVICE_IDS"]) for e in envs] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert {e["JAXFT_NUM_PROCESSES"] for e in envs} == {"3"}
    assert {e["JAX_PLATFORMS"] for e in envs} == {None}


def test_more_workers_than_gpus_is_an_error(tmp_path):
    env = _fake_gpus(tmp_path, 2)
    r = run_jaxft("launch", "-n", "3", "--", PYTHON, "-c", "pass", env=env, timeout=30)
    assert r.returncode == 2, r.describe()
    assert "-n 3 workers but this node has 2 GPU(s) (0,1)" in r.stderr and "--gpus none" in r.stderr, r.describe()
    r = run_jaxft("launch", "-n", "3", "--gpus", "none", "--console", "raw", "--", PYTHON, "-c", ENV_PRINTER, env=env,
                  timeout=60)
    assert r.returncode == 0, r.describe()
    # CPU workers: on a GPU node jax would otherwise put each of them on the default GPU.
    assert [(e["JAXFT_LOCAL_DEVICE_IDS"], e["JAX_PLATFORMS"]) for e in _envs(r.stdout)] == [(None, "cpu")] * 3
    # JAX_PLATFORMS=cpu (as the test suite sets it) means CPU workers too, GPUs or not.
    env["JAX_PLATFORMS"] = "cpu"
    r = run_jaxft("launch", "-n", "3", "--console", "raw", "--", PYTHON, "-c", ENV_PRINTER, env=env, timeout=60)
    assert r.returncode == 0, r.describe()
    assert [(e["JAXFT_LOCAL_DEVICE_IDS"], e["JAX_PLATFORMS"]) for e in _envs(r.stdout)] == [(None, "cpu")] * 3


def test_agent_numbers_its_workers_globally(tmp_path):
    env = _fake_gpus(tmp_path, 2)
    port = free_port()
    with subprocess.Popen([*JAXFT, "coordinator", "--port", str(port), "--num-processes", "6"], env=clean_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as coord:
        try:
            r = run_jaxft("launch", "--nnodes", "3", "--node-rank", "2", "--coordinator", f"127.0.0.1:{port}",
                          "--gloo-interface", "lo", "--console", "raw", "--", PYTHON, "-c", ENV_PRINTER, env=env,
                          timeout=60)
        finally:
            coord.terminate()
            coord.wait(timeout=15)
    assert r.returncode == 0, r.describe()
    envs = _envs(r.stdout)
    assert [(e["JAXFT_PROCESS_ID"], e["JAXFT_LOCAL_DEVICE_IDS"]) for e in envs] == [("4", "0"), ("5", "1")]
    assert {e["JAXFT_NUM_PROCESSES"] for e in envs} == {"6"}
    assert {e["JAXFT_COORDINATOR_ADDRESS"] for e in envs} == {f"127.0.0.1:{port}"}
    assert {e["JAXFT_GLOO_INTERFACE"] for e in envs} == {"lo"}


def test_agent_without_a_coordinator_fails_within_its_timeout():
    t0 = time.monotonic()
    r = run_jaxft("launch", "--nnodes", "2", "--node-rank", "1", "-n", "1", "--coordinator", f"127.0.0.1:{free_port()}",
                  "--timeout", "initialization=2", "--", PYTHON, "-c", "pass", timeout=30)
    assert r.returncode == 2, r.describe()
    assert time.monotonic() - t0 < 10, r.describe()
    assert "node 1: cannot reach the coordinator at 127.0.0.1:" in r.stderr, r.describe()
    assert "Timeouts.initialization=2 s" in r.stderr and r.stderr.count("\n") == 1, r.describe()


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2", "-n", "1"], "--nnodes > 1 needs --coordinator HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "-n", "1", "--coordinator", "h:1"], "--node-rank must be in [0, 2), got 2"),
    (["--host-coordinator", "-n", "1"], "--host-coordinator needs --coordinator HOST:PORT"),
    (["--coordinator", "nohostport", "-n", "1"], "--coordinator must be HOST:PORT, got 'nohostport'"),
    (["--nnodes", "0", "-n", "1"], "--nnodes must be >= 1, got 0"),
])
def test_bad_agent_options_are_one_line_errors(args, message):
    r = run_jaxft("launch", *args, "--gpus", "none", "--", PYTHON, "-c", "pass", timeout=30)
    assert r.returncode == 2, r.describe()
    assert message in r.stderr and r.stderr.count("\n") == 1, r.describe()


@pytest.mark.soak  # long: the default suite stays under its time budget
def test_two_agents_train_together(tmp_path):
    """Node 0 hosts the service (--host-coordinator), node 1 dials it; 2 workers each, one run."""
    port = free_port()
    common = ["launch", "--nnodes", "2", "-n", "2", "--gpus", "none", "--coordinator", f"127.0.0.1:{port}",
              "--bind", "127.0.0.1", "--run-dir", str(tmp_path)]
    worker = ["--", PYTHON, MLP, "--steps", "12", "--hidden", "8"]
    host = subprocess.Popen([*JAXFT, *common, "--node-rank", "0", "--host-coordinator", *worker], env=clean_env(),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:  # node 1 waits (up to Timeouts.initialization) until node 0's service listens
        other = subprocess.run([*JAXFT, *common, "--node-rank", "1", *worker], env=clean_env(), cwd=REPO,
                               capture_output=True, text=True, timeout=180)
        out, _ = host.communicate(timeout=60)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
    assert host.returncode == 0 and other.returncode == 0, f"{out}\n{other.stdout}\n{other.stderr}"
    evts = events(tmp_path)
    finals = by_event(evts, "final")
    assert sorted(f["process"] for f in finals) == [0, 1, 2, 3]
    assert len({f["params_sha256"] for f in finals}) == 1
    assert {tuple(e["members"]) for e in by_event(evts, "commit")} == {(0, 1, 2, 3)}
    assert (tmp_path / "summary-node0.json").exists() and (tmp_path / "summary-node1.json").exists()

"""Losing a standalone coordinator while workers run under an agent: once a coordinator
answers again at the same address, every worker is restarted and cold-restores the latest
complete checkpoint; if none comes back within Timeouts.initialization, the agent says so
and exits non-zero. Nothing hangs. Real processes, real SIGKILL."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import JAXFT, MLP, PYTHON, REPO, by_event, clean_env, events, finals, free_port, launch, wait_for

FIGURES = Path(os.environ.get("JAXFT_TEST_FIGURES_COORD", "/tmp/jaxft-coordinator-loss-figures.json"))
WORKER = [PYTHON, MLP, "--steps", "40", "--step_sleep", "0.2", "--checkpoint_every", "5", "--hidden", "16"]


def _coordinator(port: int) -> subprocess.Popen:
    return subprocess.Popen([*JAXFT, "coordinator", "--port", str(port), "--num-processes", "2",
                             "--heartbeat-timeout", "3"], env=clean_env(), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait()


@pytest.mark.soak  # long: the default suite stays under its time budget
def test_run_comes_back_with_a_new_coordinator(tmp_path):
    ref = launch(2, WORKER, run_dir=tmp_path / "ref", timeout=180)
    assert ref.returncode == 0, ref.describe()
    (reference,) = {f["params_sha256"] for f in finals(events(tmp_path / "ref"))}

    run = tmp_path / "run"
    port = free_port()
    first = _coordinator(port)
    agent = subprocess.Popen([*JAXFT, "launch", "-n", "2", "--coordinator", f"127.0.0.1:{port}", "--restart",
                              "on-failure", "--run-dir", str(run), "--", *WORKER], env=clean_env(), cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    second = None
    try:
        wait_for(lambda: by_event(events(run), "commit", step=12), timeout=120, interval=0.2, what="step 12")
        t_kill = time.time()
        first.kill()
        first.wait()
        time.sleep(3)  # the agent must hold its workers' restarts until a coordinator answers
        second = _coordinator(port)
        out, _ = agent.communicate(timeout=240)
    finally:
        _stop(agent)
        _stop(first)
        if second is not None:
            _stop(second)
    assert agent.returncode == 0, out
    ev = events(run)
    assert by_event(ev, "coordinator_lost") and by_event(ev, "coordinator_back"), out
    restored = by_event(ev, "restored")
    assert sorted(e["process"] for e in restored) == [0, 1] and {e["step"] for e in restored} <= {10, 15}, restored
    f = finals(ev)
    assert sorted(x["process"] for x in f) == [0, 1] and {x["params_sha256"] for x in f} == {reference}, f
    later = [e["time"] for e in by_event(ev, "commit") if e["time"] > t_kill and e["step"] >= restored[0]["step"]]
    data = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    data["coordinator_loss"] = {"kill_to_next_commit_s": round(min(later) - t_kill, 2),
                                "restored_step": restored[0]["step"], "coordinator_down_s": 3}
    FIGURES.write_text(json.dumps(data, indent=2))


def test_agent_gives_up_when_the_coordinator_stays_away(tmp_path):
    run = tmp_path / "run"
    port = free_port()
    coord = _coordinator(port)
    agent = subprocess.Popen([*JAXFT, "launch", "-n", "2", "--coordinator", f"127.0.0.1:{port}", "--restart",
                              "on-failure", "--timeout", "initialization=5", "--run-dir", str(run), "--", *WORKER],
                             env=clean_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: by_event(events(run), "commit", step=3), timeout=120, interval=0.2, what="step 3")
        coord.kill()
        coord.wait()
        t0 = time.monotonic()
        out, _ = agent.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        _stop(agent)
        _stop(coord)
    assert agent.returncode == 1, out
    assert f"lost the coordinator at 127.0.0.1:{port}: no answer for Timeouts.initialization=5 s" in out, out
    assert elapsed < 30, (elapsed, out)
    assert by_event(events(run), "coordinator_gone")

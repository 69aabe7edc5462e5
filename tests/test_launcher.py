"""``jaxft launch`` and ``jaxft coordinator``: real processes, real signals, no jax in workers."""

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    JAXFT,
    PYTHON,
    busy_port,
    by_event,
    clean_env,
    events,
    free_port,
    launch,
    processes_with,
    read_line,
    run,
    run_jaxft,
    started,
    summary,
    wait_for,
)

FAST = 10  # seconds: every refusal of bad input must come back at least this fast


def py(code: str, *args: str) -> list[str]:
    """A worker command: ``python -c CODE ARGS`` with the interpreter running the tests."""
    return [PYTHON, "-c", code, *args]


# -- bad input ---------------------------------------------------------------------------

def _refused(result, *needles):
    assert result.returncode != 0, result.describe()
    assert result.elapsed < FAST, result.describe()
    for needle in needles:
        assert needle in result.stderr, result.describe()


@pytest.mark.smoke
def test_zero_processes_refused():
    r = run_jaxft("launch", "-n", "0", "--", PYTHON, "-c", "pass", timeout=30)
    _refused(r, "jaxft launch: error:", "-n must be >= 1, got 0")


@pytest.mark.parametrize("tail", [[], ["--"]], ids=["nothing", "bare-dashes"])
def test_no_command_refused(tail):
    r = run_jaxft("launch", "-n", "2", *tail, timeout=30)
    _refused(r, "no worker command given", "usage: jaxft launch -n N")


def test_busy_port_refused():
    with busy_port() as port:
        r = run_jaxft("launch", "-n", "2", "--port", str(port), "--", PYTHON, "-c", "pass", timeout=30)
    _refused(r, f"port {port} on 127.0.0.1 is already in use")


def test_a_port_picked_for_the_service_is_outside_the_ephemeral_range():
    """A port the kernel hands out for port 0 is one any outgoing connection may take before the
    service binds it (a CI run's coordinator then died with SIGSEGV): ``--port 0`` picks one
    below the range, free at the time of asking."""
    from jaxft import net

    low, _ = net._ephemeral_range()
    ports = {net.free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), (low, sorted(ports))
    assert len(ports) > 1  # (drawn at random: two launchers at once rarely meet)
    with socket.socket() as s:
        s.bind(("127.0.0.1", net.free_port()))  # free indeed (this raises otherwise)


def test_missing_worker_command_refused():
    r = run_jaxft("launch", "-n", "2", "--", "/nonexistent/jaxft-worker", "--flag", timeout=30)
    _refused(r, "worker command '/nonexistent/jaxft-worker' not found")
    r = run_jaxft("launch", "-n", "2", "--", "jaxft-no-such-program-on-path", timeout=30)
    _refused(r, "'jaxft-no-such-program-on-path' not found")


@pytest.mark.parametrize("spec, needle", [
    ("explode:process=0:step=1", "unknown action 'explode'"),
    ("kill:process=0", "give exactly one trigger"),
    ("kill:process=5:after=1s", "process 5 does not exist (processes are 0..1)"),
])
def test_invalid_fault_refused(spec, needle):
    r = run_jaxft("launch", "-n", "2", "--fault", spec, "--", PYTHON, "-c", "pass", timeout=30)
    _refused(r, "jaxft launch: error:", needle)


def test_bad_restart_policy_refused():
    r = run_jaxft("launch", "-n", "2", "--restart", "always", "--", PYTHON, "-c", "pass", timeout=30)
    _refused(r, "invalid choice: 'always'")


# -- jaxft coordinator -------------------------------------------------------------------

def test_coordinator_busy_port_fails_fast():
    with busy_port() as port:
        r = run_jaxft("coordinator", "--port", str(port), "--num-processes", "2", timeout=30)
    _refused(r, "jaxft coordinator: error:", "already in use")


def test_coordinator_serves_until_sigterm():
    port = free_port()
    with started([*JAXFT, "coordinator", "--port", str(port), "--num-processes", "2"],
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        line = read_line(proc.stdout, timeout=30)
        assert line.strip() == f"jaxft coordinator listening on 127.0.0.1:{port} for 2 processes", line
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # it really listens
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 10
    with socket.socket() as s:  # and released the port
        s.bind(("127.0.0.1", port))


# -- plain workers ----------------------------------------------------------------------

HELLO = ("import os; e = os.environ; "
         "print('hello from', e['JAXFT_PROCESS_ID'], 'of', e['JAXFT_NUM_PROCESSES'], "
         "'inc', e['JAXFT_INCARNATION'], 'ext', e['JAXFT_EXTERNAL_COORDINATOR'], "
         "'coord', e['JAXFT_COORDINATOR_ADDRESS'], 'run', e.get('JAXFT_RUN_DIR'))")


@pytest.mark.smoke
def test_all_workers_succeed(run_dir):
    r = launch(3, py(HELLO), run_dir=run_dir, timeout=60)
    assert r.returncode == 0, r.describe()
    lines = r.stdout.splitlines()
    for i in range(3):
        mine = [l for l in lines if l.startswith(f"[{i}] ")]
        assert len(mine) == 1, r.describe()
        assert mine[0].startswith(f"[{i}] hello from {i} of 3 inc 0 ext 1 coord 127.0.0.1:"), mine
        assert mine[0].endswith(f"run {run_dir.resolve()}"), mine
    assert any(l.startswith("[jaxft] done in") for l in lines)
    s = summary(run_dir)
    assert s["processes"] == 3
    assert s["restarts"] == {"0": 0, "1": 0, "2": 0}
    assert s["exit_code"] == 0
    assert isinstance(s["wall_s"], float) and 0 < s["wall_s"] < 60
    assert s["final_returncodes"] == {"0": 0, "1": 0, "2": 0}
    ev = events(run_dir)
    assert [e["event"] for e in ev][0] == "run_start" and ev[-1]["event"] == "run_end"
    assert sorted(e["process"] for e in by_event(ev, "launch")) == [0, 1, 2]
    assert sorted(e["process"] for e in by_event(ev, "exit", code=0)) == [0, 1, 2]
    assert by_event(ev, "run_end")[0]["exit_code"] == 0


def test_one_worker_fails_restart_never(run_dir):
    code = "import os, sys; print('bye'); sys.exit(3 if os.environ['JAXFT_PROCESS_ID'] == '1' else 0)"
    r = launch(3, py(code), "--restart", "never", run_dir=run_dir, timeout=60)
    assert r.returncode == 1, r.describe()
    assert "[1] bye" in r.stdout.splitlines()
    assert "[jaxft] process 1 (incarnation 0) exit code 3" in r.stdout
    s = summary(run_dir)
    assert s["exit_code"] == 1
    assert s["restarts"] == {"0": 0, "1": 0, "2": 0}
    assert s["final_returncodes"] == {"0": 0, "1": 3, "2": 0}
    assert by_event(events(run_dir), "restart") == []


def test_always_failing_worker_restarted_max_times(run_dir):
    code = ("import os, sys; e = os.environ; print('incarnation', e['JAXFT_INCARNATION']); "
            "sys.exit(3 if e['JAXFT_PROCESS_ID'] == '1' else 0)")
    r = launch(2, py(code), "--restart", "on-failure", "--max-restarts", "2", "--max-setup-crashes", "0",
               run_dir=run_dir, timeout=60)
    assert r.returncode == 1, r.describe()
    s = summary(run_dir)
    assert s["restarts"] == {"0": 0, "1": 2}
    assert s["exit_code"] == 1
    assert s["final_returncodes"] == {"0": 0, "1": 3}
    ev = events(run_dir)
    restarts = by_event(ev, "restart", process=1)
    assert [e["incarnation"] for e in restarts] == [1, 2]
    assert [e["restarts"] for e in restarts] == [1, 2]
    assert by_event(ev, "restart", process=0) == []
    assert [e["incarnation"] for e in by_event(ev, "launch", process=1)] == [0, 1, 2]
    assert [e["code"] for e in by_event(ev, "exit", process=1)] == [3, 3, 3]
    lines = r.stdout.splitlines()
    assert [l for l in lines if l.startswith("[1] ")] == [
        "[1] incarnation 0", "[1] incarnation 1", "[1] incarnation 2"]
    assert "[jaxft] restarting process 1 (restart 2/2)" in lines


def test_worker_recovers_after_one_restart(run_dir):
    code = "import os, sys; sys.exit(7 if os.environ['JAXFT_INCARNATION'] == '0' else 0)"
    r = launch(2, py(code), "--restart", "on-failure", run_dir=run_dir, timeout=60)
    assert r.returncode == 0, r.describe()
    s = summary(run_dir)
    assert s["restarts"] == {"0": 1, "1": 1}
    assert s["final_returncodes"] == {"0": 0, "1": 0}
    assert s["exit_code"] == 0


@pytest.mark.parametrize("nice", [0, 10])
def test_nice_restarts_start_only_restarted_workers_niced(run_dir, nice):
    from jaxft import priority

    if nice and priority.lowered_nice(nice) is None:
        pytest.skip("this user could not undo a lowered priority (not root, RLIMIT_NICE too small)")
    import os

    base = os.getpriority(os.PRIO_PROCESS, 0)
    code = ("import os, sys; e = os.environ; "
            "print('inc', e['JAXFT_INCARNATION'], 'nice', os.getpriority(os.PRIO_PROCESS, 0), "
            "'base', e.get('JAXFT_BASE_NICE')); sys.exit(7 if e['JAXFT_INCARNATION'] == '0' else 0)")
    r = launch(1, py(code), "--restart", "on-failure", "--nice-restarts", str(nice), run_dir=run_dir, timeout=60)
    assert r.returncode == 0, r.describe()
    lines = [l for l in r.stdout.splitlines() if l.startswith("[0] inc")]
    niced = f"nice {min(19, base + nice)} base {base}" if nice else f"nice {base} base None"
    assert lines == [f"[0] inc 0 nice {base} base None", f"[0] inc 1 {niced}"], r.describe()


def test_restart_all_takes_every_worker_down_and_up(run_dir):
    # process 1 fails once; process 0 would sleep on, but --restart all kills and restarts it
    code = ("import os, sys, time; e = os.environ\n"
            "if e['JAXFT_INCARNATION'] == '0':\n"
            "    sys.exit(5) if e['JAXFT_PROCESS_ID'] == '1' else time.sleep(60)\n")
    r = launch(2, py(code), "--restart", "all", run_dir=run_dir, timeout=60)
    assert r.returncode == 0, r.describe()
    assert r.elapsed < 30, r.describe()
    s = summary(run_dir)
    assert s["restarts"] == {"0": 1, "1": 1}
    ev = events(run_dir)
    assert by_event(ev, "exit", process=1, incarnation=0)[0]["code"] == 5
    assert by_event(ev, "exit", process=0, incarnation=0)[0]["signal"] == "SIGKILL"
    assert sorted(e["process"] for e in by_event(ev, "launch", incarnation=1)) == [0, 1]


def test_stopped_worker_is_killed_as_hung_and_restarted(run_dir):
    # A SIGSTOPped worker sends no heartbeats: dead to its peers, but it never exits.
    code = ("import os, signal, sys; e = os.environ\n"
            "if e['JAXFT_PROCESS_ID'] == '1' and e['JAXFT_INCARNATION'] == '0':\n"
            "    os.kill(os.getpid(), signal.SIGSTOP)\n")
    r = launch(2, py(code), "--restart", "on-failure", "--heartbeat-timeout", "1", run_dir=run_dir, timeout=60)
    assert r.returncode == 0, r.describe()
    assert r.elapsed < 30, r.describe()
    (hung,) = by_event(events(run_dir), "exit", process=1, incarnation=0)
    assert hung["signal"] == "SIGKILL" and hung["reason"].startswith("hung (stopped)"), hung
    assert summary(run_dir)["restarts"] == {"0": 0, "1": 1}


def test_kill_all_takes_down_a_worker_outside_the_step(run_dir):
    # process 0 reaches the kill-all's step; process 1 is still "setting up" (a restarted
    # process not yet admitted): the whole job dies, so its launcher kills process 1 too.
    code = ("import os, time; from jaxft.faults import FaultInjector\n"
            "inj = FaultInjector.from_env(int(os.environ['JAXFT_PROCESS_ID']))\n"
            "if os.environ['JAXFT_PROCESS_ID'] == '0':\n"
            "    inj.point('after-grad', 0)\n"
            "time.sleep(60)\n")
    r = launch(2, py(code), "--restart", "never", "--fault", "kill-all:step=0", run_dir=run_dir, timeout=60)
    assert r.returncode == 1, r.describe()
    assert r.elapsed < 30, r.describe()
    ev = events(run_dir)
    assert [e["signal"] for e in by_event(ev, "exit")] == ["SIGKILL", "SIGKILL"], r.describe()
    (swept,) = by_event(ev, "fault", source="launcher")
    assert swept["process"] == 1 and swept["action"] == "kill-all", swept
    assert "fault kill-all:step=0:phase=after-grad: sending SIGKILL to process 1" in r.stdout, r.describe()


# -- a dead worker's children ---------------------------------------------------------------

LEAVES_A_CHILD = """
import os, signal, subprocess, sys, time
marker, how = sys.argv[1], sys.argv[2]
if os.environ["JAXFT_INCARNATION"] == "0":
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)", marker])  # holds our stdout
    print("dying at", repr(time.time()), flush=True)
    os.kill(os.getpid(), signal.SIGKILL) if how == "sigkill" else os._exit(3)
with open(os.path.join(os.environ["JAXFT_FAULT_STATE_DIR"], "deaths", "0-0")) as f:
    print("recorded at", f.read(), flush=True)
"""


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_a_dead_workers_children_die_and_its_death_is_recorded_at_once(run_dir, marker, how):
    # Life 0 leaves a child that holds its stdout, then dies; life 1 reads the death record.
    r = launch(1, py(LEAVES_A_CHILD, marker, how), "--restart", "on-failure", run_dir=run_dir, timeout=60)
    left = processes_with(marker)
    assert left == [], f"the dead life's child outlived the launcher: {left}\n{r.describe()}"
    assert r.returncode == 0, r.describe()
    died = float(re.search(r"^\[0\] dying at (\S+)$", r.stdout, re.M).group(1))
    recorded = float(re.search(r"^\[0\] recorded at (\S+)$", r.stdout, re.M).group(1))
    assert recorded - died < 1.0, f"death recorded {recorded - died:.2f} s after it happened\n{r.describe()}"
    (exit_,) = by_event(events(run_dir), "exit", process=0, incarnation=0)
    assert exit_["time"] - died < 1.0, f"exit event {exit_['time'] - died:.2f} s after the death"


# -- the default run dir --------------------------------------------------------------------

DEFAULT_RUN_DIR = re.compile(r"^\[jaxft\] run dir (\S+) \(default; pass --run-dir to choose\)", re.M)
PRINTS_RUN_DIR = "import os; print('RUN_DIR', os.environ.get('JAXFT_RUN_DIR'))"


def _default_run_dir(*command: str, env: dict, cwd: Path, console: str = "raw") -> Path:
    """Launch ``command`` without --run-dir from ``cwd``; the run dir it says it chose."""
    r = run([*JAXFT, "launch", "-n", "1", "--console", console, "--", *command], env=env, cwd=cwd, timeout=60)
    assert r.returncode == 0, r.describe()
    found = DEFAULT_RUN_DIR.search(r.stdout)
    assert found, f"no 'run dir ... (default; ...)' line\n{r.describe()}"
    path = Path(os.path.realpath(cwd), found.group(1))  # the launcher's cwd is a real path
    if console == "raw":  # the workers' $JAXFT_RUN_DIR: where their checkpoints go
        assert f"[0] RUN_DIR {path}" in r.stdout.splitlines(), r.describe()
    return path


def test_without_run_dir_a_relaunch_of_the_same_command_uses_the_same_run_dir(tmp_path):
    # Under $JAXFT_RUNS_DIR when set, else ./jaxft-runs; named after the command and the cwd.
    runs, here, there = tmp_path / "runs", tmp_path / "here", tmp_path / "there"
    for d in (here, there):
        d.mkdir()
        (d / "hello.py").write_text(PRINTS_RUN_DIR)
    env = clean_env(JAXFT_RUNS_DIR=str(runs))
    first = _default_run_dir(PYTHON, "hello.py", env=env, cwd=here)
    again = _default_run_dir(PYTHON, "hello.py", env=env, cwd=here, console="progress")
    assert first.parent == runs and first.name.startswith("hello-") and again == first, (first, again)
    assert len(by_event(events(first), "run_start")) == 2 and summary(first)["exit_code"] == 0
    other = _default_run_dir(PYTHON, "-c", PRINTS_RUN_DIR, env=env, cwd=here)
    elsewhere = _default_run_dir(PYTHON, "hello.py", env=env, cwd=there)
    assert len({first, other, elsewhere}) == 3 and other.parent == runs == elsewhere.parent, (first, other, elsewhere)
    env.pop("JAXFT_RUNS_DIR")
    local = _default_run_dir(PYTHON, "hello.py", env=env, cwd=here)
    assert local.parent == Path(os.path.realpath(here), "jaxft-runs") and local.name == first.name, local


# -- stopping -----------------------------------------------------------------------------

SLEEPER = """
import os, signal, sys, time
ready_dir, marker, stubborn = sys.argv[1], sys.argv[2], sys.argv[3]
pid = os.environ["JAXFT_PROCESS_ID"]
if pid == stubborn:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(ready_dir, "ready-" + pid), "w").close()
print("sleeping", flush=True)
time.sleep(120)
"""


def _workers_of(marker: str, launcher_pid: int) -> list[tuple[int, str]]:
    return [(pid, cmd) for pid, cmd in processes_with(marker) if pid != launcher_pid]


def _start_sleepers(tmp_path, marker, grace: float, stubborn: str = "1"):
    ready = tmp_path / "ready"
    ready.mkdir()
    args = [*JAXFT, "launch", "-n", "3", "--console", "raw", "--grace", str(grace), "--run-dir", str(tmp_path / "run"),
            "--", *py(SLEEPER, str(ready), marker, stubborn)]
    return ready, args


def _wait_ready(proc, ready, marker):
    wait_for(lambda: len(list(ready.iterdir())) == 3 or proc.poll() is not None, timeout=30,
             what="3 workers to be ready")
    assert proc.poll() is None, "the launcher exited early"
    workers = wait_for(lambda: (w := _workers_of(marker, proc.pid)) and len(w) == 3 and w, timeout=10,
                       what="pgrep to show 3 workers")
    print(f"pgrep -af {marker} before:\n" + "\n".join(f"{p} ...{c[-90:]}" for p, c in workers))
    return workers


def test_ctrl_c_stops_every_worker(tmp_path, marker):
    grace = 2.0
    ready, args = _start_sleepers(tmp_path, marker, grace, stubborn="1")
    with started(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        _wait_ready(proc, ready, marker)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=grace + 5)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not exit within grace + 5 s after SIGINT; "
                        f"still running: {processes_with(marker)}")
        elapsed = time.monotonic() - t0
    after = processes_with(marker)
    print(f"pgrep -af {marker} after ({elapsed:.1f} s): {after or 'nothing'}")
    assert after == [], f"processes survived the launcher: {after}"
    assert proc.returncode == 128 + signal.SIGINT, out
    assert elapsed < grace + 5
    assert elapsed >= grace * 0.9, "the stubborn worker must get its grace period"
    assert "[jaxft] received SIGINT; stopping all workers" in out
    assert "process 1 ignored SIGTERM for 2 s; SIGKILL" in out
    ev = events(tmp_path / "run")
    assert by_event(ev, "interrupted", signal="SIGINT")
    assert sorted(e["process"] for e in by_event(ev, "exit", reason="terminated by launcher")) == [0, 1, 2]
    assert summary(tmp_path / "run")["exit_code"] == 130


def test_sigkilled_launcher_takes_its_workers_along(tmp_path, marker):
    ready, args = _start_sleepers(tmp_path, marker, grace=5.0, stubborn="2")
    with started(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        workers = _wait_ready(proc, ready, marker)
        proc.kill()  # SIGKILL: no handler runs, only PR_SET_PDEATHSIG can clean up
        proc.wait(timeout=10)
        wait_for(lambda: not processes_with(marker), timeout=5,
                 what=f"the workers {[p for p, _ in workers]} to die with their launcher")
    print(f"pgrep -af {marker} after: {processes_with(marker) or 'nothing'}")

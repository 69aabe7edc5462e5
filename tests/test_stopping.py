"""Stopping a run cleanly, and the launcher defects of the reliability issue.

Real processes: SIGTERM to a launcher whose workers run JAX all-reduces, `--restart all`
bookkeeping, configuration errors that must not be retried, fault-marker directories of
SIGKILLed launchers, and bad launcher input that must be one line, not a traceback.
"""

import glob
import os
import signal
import subprocess
import tempfile
import time

import pytest
from helpers import (
    ALLREDUCE_WORKER,
    JAXFT,
    MLP,
    PYTHON,
    by_event,
    events,
    launch,
    processes_with,
    run_jaxft,
    started,
    stop_with_checkpoint,
    summary,
    wait_for,
)


def test_sigterm_ends_workers_before_the_service(tmp_path, marker):
    """Workers first, then the coordination service: no crash output, every exit recorded."""
    run = tmp_path / "run"
    args = [*JAXFT, "launch", "-n", "3", "--run-dir", str(run), "--grace", "20", "--console", "raw", "--",
            PYTHON, str(ALLREDUCE_WORKER), "--seconds", "120", marker]
    with started(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        wait_for(lambda: len({e["process"] for e in by_event(events(run), "allreduce")}) == 3, timeout=90,
                 interval=0.2, what="3 workers all-reducing")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=40)
        elapsed = time.monotonic() - t0
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "ignored SIGTERM" not in out, out  # each worker ended on SIGTERM itself, no SIGKILL needed
    for crash in ("Fatal Python error", "Connection refused", "Traceback", "UNAVAILABLE"):
        assert crash not in out, out
    s = summary(run)
    assert sorted(e["process"] for e in s["exits"]) == [0, 1, 2], s
    assert all(e.get("code") == 128 + signal.SIGTERM for e in s["exits"]), s
    assert elapsed < 20, (elapsed, out)
    assert not processes_with(marker)


# Process 1 dies inside step 1; process 0, still in that step, is told to stop (SystemExit, what
# the SIGTERM handler raises) once the launcher has recorded the death.
EXIT_IN_A_FAILED_STEP = r"""
import os, sys, time
import jaxft
rt = jaxft.initialize()
group = jaxft.ElasticGroup(admission=sys.argv[1])
with group.step():
    pass
try:
    with group.step():
        if rt.process_id == 1:
            os._exit(9)
        time.sleep(1.5)
        raise SystemExit(3)
except jaxft.StepFailed as e:
    print("step failed", sorted(e.failed), flush=True)
    sys.exit(4)
"""


@pytest.mark.parametrize("admission", ["connect", "ready"])
def test_a_stop_inside_a_step_whose_member_died_is_not_a_failed_step(tmp_path, admission):
    # The launcher's SIGTERM reaches every worker; one already gone when another, inside the
    # step, raises SystemExit there: that process must leave, not retry the step on its own
    # (seen: the last worker trained alone for 20 s until the launcher's SIGKILL).
    r = launch(2, [PYTHON, "-c", EXIT_IN_A_FAILED_STEP, admission], "--heartbeat-timeout", "3",
               run_dir=tmp_path, timeout=120)
    assert "step failed" not in r.stdout, r.describe()
    codes = {e["process"]: e.get("code") for e in by_event(events(tmp_path), "exit")}
    assert codes == {0: 3, 1: 9}, (codes, r.describe())


def _sh(code: str) -> list[str]:
    return [PYTHON, "-c", code]


def test_restart_all_keeps_finished_workers_and_records_every_exit(tmp_path):
    """p0 finishes (exit 0) first; p1 and p2 then fail together once: p0 is not restarted,
    both failures get exit events, and the budget counts rounds."""
    flag = tmp_path / "failed-once"
    code = f"""
import os, sys, time, pathlib
pid = int(os.environ["JAXFT_PROCESS_ID"])
flag = pathlib.Path({str(flag)!r})
if pid == 0:
    sys.exit(0)
if flag.exists():
    sys.exit(0)
time.sleep(1.5)  # p0 is done by now
if pid == 1:
    flag.touch()
    sys.exit(3)
deadline = time.monotonic() + 30  # (p2 fails after p1 marked its failure: failing first, it was
while not flag.exists() and time.monotonic() < deadline:  # restarted with p1 before p1 marked it,
    time.sleep(0.01)  # and both failed again, a second round: the clean-clone CI of session 35)
sys.exit(4)
"""
    r = launch(3, _sh(code), "--restart", "all", run_dir=tmp_path / "run", timeout=60)
    assert r.returncode == 0, r.describe()
    ev = events(tmp_path / "run")
    launches = {p: len(by_event(ev, "launch", process=p)) for p in range(3)}
    assert launches == {0: 1, 1: 2, 2: 2}, (launches, r.describe())
    for p in (1, 2):  # the first life of each failed worker has an exit event, whoever noticed it first
        assert by_event(ev, "exit", process=p, incarnation=0), r.describe()
    assert summary(tmp_path / "run")["restarts"] == {"0": 0, "1": 1, "2": 1}


def test_configuration_error_is_not_retried(tmp_path):
    code = ("import jaxft\njaxft.initialize()\n"
            "raise jaxft.CheckpointMismatch('checkpoint 10 has 6 leaves, the model has 4')\n")
    r = launch(2, _sh(code), "--restart", "on-failure", run_dir=tmp_path / "run", timeout=60)
    assert r.returncode == 1, r.describe()
    assert r.elapsed < 30, r.describe()
    assert "Traceback" not in r.stdout + r.stderr, r.describe()
    assert r.stdout.count("jaxft: configuration error (CheckpointMismatch): checkpoint 10 has 6 leaves") == 2
    s = summary(tmp_path / "run")
    assert s["restarts"] == {"0": 0, "1": 0}, s
    assert {e["code"] for e in s["exits"]} == {78}, s


def test_an_unsupported_orbax_stops_the_worker_before_it_trains(tmp_path):
    # (orbax-checkpoint 0.12.4, on a GPU machine's image, saved fine and failed every restore)
    code = ("import importlib.metadata as md\nreal = md.version\n"
            "md.version = lambda name: '0.12.4' if name == 'orbax-checkpoint' else real(name)\n"
            "import jaxft\njaxft.initialize()\njaxft.ElasticCheckpointer\n")
    r = launch(1, _sh(code), "--restart", "on-failure", run_dir=tmp_path / "run", timeout=60)
    assert r.returncode == 1, r.describe()
    assert "Traceback" not in r.stdout + r.stderr, r.describe()
    assert ("jaxft: configuration error (UnsupportedOrbax): jaxft's checkpoints need "
            "orbax-checkpoint>=0.12.8,<0.13, found 0.12.4") in r.stdout, r.describe()
    assert summary(tmp_path / "run")["restarts"] == {"0": 0}


def test_sigkilled_launchers_fault_markers_are_cleaned_up(tmp_path, marker):
    args = [*JAXFT, "launch", "-n", "1", "--", PYTHON, "-c", "import time; time.sleep(60)", marker]
    with started(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        pattern = os.path.join(tempfile.gettempdir(), f"jaxft-faults-{proc.pid}-*")
        wait_for(lambda: glob.glob(pattern), timeout=20, what="the launcher's fault directory")
        proc.kill()
        proc.wait()
    wait_for(lambda: not processes_with(marker), timeout=10, what="the worker to die with its launcher")
    assert glob.glob(pattern), "a SIGKILLed launcher cannot clean up after itself"
    r = launch(1, _sh("pass"), timeout=30)
    assert r.returncode == 0, r.describe()
    assert not glob.glob(pattern), "the next launcher removes the fault directories of dead launchers"


@pytest.mark.parametrize("args, message", [
    (["--run-dir", "/proc/jaxft-x"], "--run-dir '/proc/jaxft-x': cannot create it"),
    (["--port", "99999"], "--port must be in 0..65535 (0: a free one), got 99999"),
    (["--grace", "-1"], "--grace must be >= 0"),
])
def test_bad_launcher_input_is_one_line(tmp_path, args, message):
    r = run_jaxft("launch", "-n", "1", "--gpus", "none", *args, "--", PYTHON, "-c", "pass", timeout=30)
    assert r.returncode == 2, r.describe()
    assert r.elapsed < 10, r.describe()
    assert r.stderr.startswith("jaxft launch: error: ") and r.stderr.count("\n") == 1, r.describe()
    assert message in r.stderr, r.describe()
    assert "done in" not in r.stdout and "Traceback" not in r.stderr, r.describe()


@pytest.mark.parametrize("content", ["", '{"foo": "bar"}\n', "[1, 2]\nnot json\n"])
def test_report_on_a_file_without_events_is_one_line(tmp_path, content):
    (tmp_path / "events.jsonl").write_text(content)
    r = run_jaxft("report", str(tmp_path), timeout=60)
    assert r.returncode == 2, r.describe()
    assert r.stdout.strip() == f"jaxft report: {tmp_path / 'events.jsonl'} holds no events", r.describe()
    assert "Traceback" not in r.stderr, r.describe()


def test_report_skips_lines_that_are_not_events(tmp_path):
    good = '{"time": 1.0, "event": "commit", "process": 0, "incarnation": 0, "step": 0, "members": [0], "loss": 1.0}'
    (tmp_path / "events.jsonl").write_text(f'{{"foo": "bar"}}\n{good}\n{{"time": "x", "event": 1, "process": 0}}\n')
    r = run_jaxft("report", str(tmp_path), "--json", timeout=60)
    assert r.returncode == 0, r.describe()
    assert '"steps_committed": 1' in r.stdout, r.describe()


@pytest.mark.soak  # long: the default suite stays under its time budget
def test_checkpoint_on_stop_saves_a_last_checkpoint_and_resumes_there(tmp_path, marker):
    run = tmp_path / "run"
    worker = [PYTHON, str(MLP), "--steps", "400", "--step_sleep", "0.1", "--checkpoint_every", "1000",
              "--hidden", "16", marker]
    _, step = stop_with_checkpoint(run, worker)
    # The next run of the same job starts from that checkpoint.
    again = launch(2, [PYTHON, str(MLP), "--steps", str(step + 2), "--checkpoint_every", "1000", "--hidden", "16"],
                   run_dir=run, timeout=120)
    assert again.returncode == 0, again.describe()
    assert {e["step"] for e in by_event(events(run), "restored")} == {step}

"""The launcher's crash-loop guard (``jaxft.supervisor.crashloop``): a worker that crashes the same way
before its first committed step, life after life, is not restarted on; a fault is never
taken for such a crash. Real processes, real exits and signals."""

import signal

import pytest
from helpers import PYTHON, by_event, events, launch, summary

from jaxft import protocol
from jaxft.supervisor import crashloop

CRASH_SETUP = "import os, sys; print('life', os.environ['JAXFT_INCARNATION']); sys.exit({code})"


def py(code: str) -> list[str]:
    return [PYTHON, "-c", code]


def test_exit_codes_that_count_as_set_up_crashes():
    from jaxft.protocol import EXIT_BARRIER_TIMEOUT, EXIT_HUNG

    assert crashloop._NOT_CRASHES == (EXIT_BARRIER_TIMEOUT, EXIT_HUNG)  # kept in step with their modules
    assert crashloop.is_crash(1) and crashloop.is_crash(3) and crashloop.is_crash(-signal.SIGSEGV)
    assert crashloop.is_crash(-signal.SIGABRT)
    for code in (0, EXIT_BARRIER_TIMEOUT, EXIT_HUNG, -signal.SIGKILL, -signal.SIGTERM, -signal.SIGINT):
        assert not crashloop.is_crash(code), code


def test_lives_in_a_row_with_one_exit_status(tmp_path):
    f = crashloop.SetupFailures(str(tmp_path), limit=3)
    assert [f.record(1, i, 3) for i in range(2)] == [1, 2] and not f.tripped(1)
    assert f.record(1, 2, 4) == 1  # another exit status starts a new run
    assert f.record(1, 3, -signal.SIGKILL) == 0  # a fault ends the run
    assert [f.record(1, i, 4) for i in (4, 5, 6)] == [1, 2, 3] and f.tripped(1)
    assert not f.tripped(0)
    (tmp_path / protocol.COMMITTED).mkdir()
    (tmp_path / protocol.COMMITTED / "0-7").touch()  # life 7 of process 0 committed a step
    assert f.record(0, 6, 3) == 1 and f.record(0, 7, 3) == 0 and not f.tripped(0)
    assert not crashloop.SetupFailures(str(tmp_path), limit=0).tripped(1)


@pytest.mark.smoke
def test_a_worker_crashing_in_set_up_is_not_restarted_past_the_limit(tmp_path):
    code = ("import os, sys; e = os.environ; print('life', e['JAXFT_INCARNATION']); "
            "sys.exit(3 if e['JAXFT_PROCESS_ID'] == '1' else 0)")
    r = launch(2, py(code), "--restart", "on-failure", run_dir=tmp_path, timeout=60)
    assert r.returncode == 1, r.describe()
    s = summary(tmp_path)
    assert s["restarts"] == {"0": 0, "1": 2}  # 3 lives, not --max-restarts' 10
    ev = events(tmp_path)
    assert [e["code"] for e in by_event(ev, "exit", process=1)] == [3, 3, 3]
    loop = by_event(ev, "crash_loop")
    assert [(e["process"], e["incarnation"], e["crashes"], e["code"]) for e in loop] == [(1, 2, 3, 3)]
    assert ("process 1 crashed 3 times in a row before committing a step, each time with exit code 3: "
            "a restart repeats it, not restarting it") in r.stdout, r.describe()


def test_restart_all_stops_the_job_on_a_crash_loop(tmp_path):
    code = ("import os, sys, time; e = os.environ; print('life', e['JAXFT_INCARNATION']); "
            "sys.exit(3) if e['JAXFT_PROCESS_ID'] == '1' else time.sleep(60)")
    r = launch(2, py(code), "--restart", "all", "--max-setup-crashes", "2", run_dir=tmp_path, timeout=60)
    assert r.returncode == 1, r.describe()
    assert r.elapsed < 30, r.describe()  # process 0 (asleep for 60 s) was ended with the job
    ev = events(tmp_path)
    assert [e["crashes"] for e in by_event(ev, "crash_loop", process=1)] == [2]
    assert "stopping the job (--restart all restarts every worker or none)" in r.stdout, r.describe()


@pytest.mark.parametrize("how, restarts", [
    ("sys.exit(3 + int(e['JAXFT_INCARNATION']) % 2)", 4),  # a different exit status each life
    ("os.kill(os.getpid(), signal.SIGKILL)", 4),  # killed: a fault, not a crash
    ("sys.exit(3)", 0),  # --max-setup-crashes 1: the first crash is enough
], ids=["alternating-codes", "sigkill", "limit-1"])
def test_only_alike_crashes_count(tmp_path, how, restarts):
    code = f"import os, signal, sys; e = os.environ; {how}"
    r = launch(1, py(code), "--restart", "on-failure", "--max-restarts", "4",
               *(["--max-setup-crashes", "1"] if restarts == 0 else []), run_dir=tmp_path, timeout=60)
    assert r.returncode == 1, r.describe()
    assert summary(tmp_path)["restarts"] == {"0": restarts}
    assert len(by_event(events(tmp_path), "crash_loop")) == (1 if restarts == 0 else 0)


def test_max_setup_crashes_0_turns_the_guard_off(tmp_path):
    r = launch(1, py(CRASH_SETUP.format(code=3)), "--restart", "on-failure", "--max-restarts", "4",
               "--max-setup-crashes", "0", run_dir=tmp_path, timeout=60)
    assert r.returncode == 1, r.describe()
    assert summary(tmp_path)["restarts"] == {"0": 4}
    assert by_event(events(tmp_path), "crash_loop") == []


# A jaxft worker: one committed step of an ElasticGroup (connect or ready admission), then a crash
# (before the step with `early`): a life that committed is a fault of the run, not of its set-up
COMMIT_THEN_CRASH = """
import sys
import jaxft
rt = jaxft.initialize()
if sys.argv[2] == "early":
    sys.exit(3)
group = jaxft.ElasticGroup(admission=sys.argv[1])
with group.step():
    pass
rt.events.log("committed_once")
sys.exit(3)
"""


@pytest.mark.parametrize("admission", ["connect", "ready"])
def test_a_life_that_committed_a_step_is_restarted_whatever_its_end(tmp_path, admission):
    for when, restarts in (("late", 2), ("early", 0)):
        run_dir = tmp_path / when
        r = launch(1, [PYTHON, "-c", COMMIT_THEN_CRASH, admission, when], "--restart", "on-failure",
                   "--max-restarts", "2", "--max-setup-crashes", "1", "--heartbeat-timeout", "2",
                   run_dir=run_dir, timeout=120)
        assert r.returncode == 1, r.describe()
        ev = events(run_dir)
        assert summary(run_dir)["restarts"] == {"0": restarts}, r.describe()
        assert len(by_event(ev, "committed_once")) == (3 if when == "late" else 0)
        assert [e["code"] for e in by_event(ev, "exit")] == [3] * (restarts + 1)

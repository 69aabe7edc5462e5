"""Fault specs, the once-per-run marker, and worker-side firing in real processes."""

import os
import signal
import subprocess
import time

import pytest
from helpers import PYTHON, clean_env, is_stopped, run_python, started, wait_for

from jaxft import protocol
from jaxft.faults import DEFAULT_PHASE, PHASES, FaultInjector, FaultRule, FaultSpecError, claim, parse_rule, parse_rules

# -- parsing -------------------------------------------------------------------------------


@pytest.mark.smoke
@pytest.mark.parametrize("spec, expected", [
    ("kill:process=1:step=5", FaultRule("kill", process=1, step=5, phase=DEFAULT_PHASE)),
    ("kill:process=1:step=5:phase=before-step", FaultRule("kill", process=1, step=5, phase="before-step")),
    ("kill:process=0:step=0:phase=during-save", FaultRule("kill", process=0, step=0, phase="during-save")),
    ("kill-all:step=13", FaultRule("kill-all", step=13)),
    ("kill-all:step=13:phase=after-commit", FaultRule("kill-all", step=13, phase="after-commit")),
    ("stop:process=2:step=7", FaultRule("stop", process=2, step=7)),
    ("kill:process=0:after=4.5s", FaultRule("kill", process=0, after=4.5)),
    ("kill:process=3:after=2", FaultRule("kill", process=3, after=2.0)),
    ("stop:process=1:after=0s", FaultRule("stop", process=1, after=0.0)),
    ("  kill:process=1:step=5  ", FaultRule("kill", process=1, step=5)),
])
def test_parse_rule_happy(spec, expected):
    rule = parse_rule(spec)
    assert rule == expected
    assert rule.launcher_side == (expected.after is not None)
    # The canonical spec parses back to the same rule.
    assert parse_rule(rule.spec) == rule


def test_parse_rules_forms():
    assert parse_rules(None) == []
    assert parse_rules("") == []
    assert parse_rules([]) == []
    rules = parse_rules("kill:process=1:step=5;stop:process=0:step=2;;kill:process=2:after=3s")
    assert [r.index for r in rules] == [0, 1, 2]
    assert [r.action for r in rules] == ["kill", "stop", "kill"]
    assert parse_rules(["kill:process=1:step=5", "kill-all:step=9"]) == [
        FaultRule("kill", process=1, step=5, index=0), FaultRule("kill-all", step=9, index=1)]
    assert rules[2].spec == "kill:process=2:after=3s"
    assert rules[0].spec == "kill:process=1:step=5:phase=after-grad"


@pytest.mark.smoke
@pytest.mark.parametrize("spec, message", [
    ("explode:process=1:step=5", "unknown action 'explode'"),
    ("", "unknown action ''"),
    ("kill:process=1:step=5:phase=mid-step", "unknown phase 'mid-step'"),
    ("kill:process=1:step=5:when=now", "unknown key 'when'"),
    ("kill:process=1", "give exactly one trigger"),
    ("kill:process=1:step=5:width=0", "width= takes a positive member count"),
    ("kill:process=1:after=2s:width=3", "width= takes a positive member count"),
    ("stop:process=1", "give exactly one trigger"),
    ("kill-all:phase=after-grad", "give exactly one trigger"),
    ("kill:process=1:step=5:after=3s", "give exactly one trigger"),
    ("kill-all:process=1:step=5", "kill-all takes no process"),
    ("kill-all:step=5:process=0", "kill-all takes no process"),
    ("kill-all:after=3s", "kill-all is step-triggered only"),
    ("kill:step=5", "kill needs process=N"),
    ("stop:after=1s", "stop needs process=N"),
    ("kill:process=one:step=5", "bad value for process"),
    ("kill:process=1:step=five", "bad value for step"),
    ("kill:process=1:after=soon", "bad value for after"),
    ("kill:process=1:step", "expected key=value"),
    ("kill:process=1:step=", "expected key=value"),
    ("kill:process=1:step=-1", "non-negative"),
    ("kill:process=1:after=-2s", "non-negative"),
])
def test_parse_rule_errors(spec, message):
    with pytest.raises(FaultSpecError) as info:
        parse_rule(spec)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_parse_rules_error_names_the_bad_spec():
    with pytest.raises(FaultSpecError, match="bogus"):
        parse_rules(["kill:process=1:step=5", "bogus:step=1"])


# -- the once-per-run marker ---------------------------------------------------------------


def test_claim_fires_once_per_rule_and_process(tmp_path):
    state = str(tmp_path / "state")  # created on demand
    rule_a, rule_b = parse_rules(["kill:process=1:step=5", "kill-all:step=5"])
    assert claim(state, rule_a, 1) is True
    assert claim(state, rule_a, 1) is False
    assert claim(state, rule_a, 1) is False
    assert claim(state, rule_b, 1) is True  # another rule: its own marker
    assert claim(state, rule_b, 2) is True  # kill-all: one marker per process
    assert claim(state, rule_b, 2) is False
    # The same text at another position in the rule list is another rule.
    same_text_elsewhere = parse_rules(["kill-all:step=1", "kill:process=1:step=5"])[1]
    assert claim(state, same_text_elsewhere, 1) is True
    assert sorted(os.listdir(state)) == sorted([
        rule_a.marker(1), rule_b.marker(1), rule_b.marker(2), same_text_elsewhere.marker(1)])


def test_claim_without_state_dir_always_fires():
    rule = parse_rule("kill:process=0:step=1")
    assert claim(None, rule, 0) is True
    assert claim(None, rule, 0) is True


def test_claim_is_atomic_across_processes(tmp_path):
    """Several processes race for one marker: exactly one wins."""
    go = tmp_path / "go"
    code = (
        "import os, sys, time\n"
        "from jaxft.faults import claim, parse_rule\n"
        "rule = parse_rule('kill-all:step=3')\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.005)\n"
        "print('won' if claim(sys.argv[2], rule, 0) else 'lost', flush=True)\n")
    procs = [subprocess.Popen([PYTHON, "-c", code, str(go), str(tmp_path / "state")],
                              stdout=subprocess.PIPE, text=True, env=clean_env()) for _ in range(4)]
    try:
        time.sleep(0.5)
        go.touch()
        outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sorted(outs) == ["lost", "lost", "lost", "won"], outs


# -- the worker-side injector --------------------------------------------------------------


def test_injector_keeps_only_this_process_step_rules():
    rules = parse_rules(["kill:process=1:step=5", "kill:process=0:step=2", "kill-all:step=9",
                         "stop:process=1:after=3s", "stop:process=1:step=4:phase=before-step"])
    inj = FaultInjector(rules, process_id=1)
    assert [r.index for r in inj.rules] == [0, 2, 4]
    assert [r.index for r in FaultInjector(rules, process_id=2).rules] == [2]


def test_injector_from_env(tmp_path):
    environ = {protocol.FAULTS: "kill:process=0:step=1;stop:process=1:step=9;kill:process=1:after=2s",
               protocol.FAULT_STATE_DIR: str(tmp_path)}
    inj = FaultInjector.from_env(1, environ=environ)
    assert [r.spec for r in inj.rules] == ["stop:process=1:step=9:phase=after-grad"]
    assert inj.state_dir == str(tmp_path)
    assert FaultInjector.from_env(0, environ={}).rules == []


def test_point_rejects_unknown_phase():
    inj = FaultInjector([], process_id=0)
    with pytest.raises(ValueError, match="unknown fault phase"):
        inj.point("mid-step", 1)
    inj.point("after-grad", 1)  # no rules: nothing happens


# A worker loop that walks every phase of every step and reports each point it passed.
STEPPER = """
import sys
from jaxft.faults import PHASES, FaultInjector, parse_rules
spec, pid, state_dir, steps = sys.argv[1:5]
inj = FaultInjector(parse_rules(spec), int(pid), state_dir or None,
                    on_fire=lambda rule, step: print(f"fire {rule.spec} at {step}", flush=True))
print("ready", flush=True)
for step in range(int(steps)):
    for phase in PHASES:
        inj.point(phase, step)
        print(f"passed {step} {phase}", flush=True)
print("done", flush=True)
"""


def _passed(stdout: str) -> list[tuple[int, str]]:
    out = []
    for line in stdout.splitlines():
        if line.startswith("passed "):
            _, step, phase = line.split()
            out.append((int(step), phase))
    return out


def _all_points(steps: int) -> list[tuple[int, str]]:
    return [(s, p) for s in range(steps) for p in PHASES]


def _points_before(step: int, phase: str) -> list[tuple[int, str]]:
    points = _all_points(step + 1)
    return points[:points.index((step, phase))]


@pytest.mark.smoke
def test_kill_fires_at_its_step_and_once_per_run(tmp_path):
    state = str(tmp_path / "faults")
    spec = "kill:process=1:step=3"  # default phase after-grad
    first = run_python(STEPPER, spec, "1", state, "6", timeout=60)
    assert first.returncode == -signal.SIGKILL, first.describe()
    # Every point before (3, after-grad) was passed, and none after it.
    assert _passed(first.stdout) == _points_before(3, "after-grad"), first.describe()
    assert first.stdout.splitlines()[-1] == "fire kill:process=1:step=3:phase=after-grad at 3"
    assert "done" not in first.stdout

    # A restarted worker (same state dir) passes the point: the rule fired already.
    second = run_python(STEPPER, spec, "1", state, "6", timeout=60)
    assert second.returncode == 0, second.describe()
    assert "fire" not in second.stdout
    assert _passed(second.stdout) == _all_points(6)

    # Another process never fires a rule aimed at process 1.
    other = run_python(STEPPER, spec, "0", str(tmp_path / "fresh"), "6", timeout=60)
    assert other.returncode == 0, other.describe()
    assert "fire" not in other.stdout


# A worker that creates its injector (its life begins), waits for "go" on stdin, then walks
# the phases of every step, entering each at the width given for it ("4f": at 4, and the
# attempt fails right after it entered; not retried here).
WAITING_STEPPER = """
import sys
from jaxft.faults import PHASES, FaultInjector, parse_rules
spec, pid, state_dir, widths = sys.argv[1:5]
inj = FaultInjector(parse_rules(spec), int(pid), state_dir or None,
                    on_fire=lambda rule, step: print(f"fire {rule.spec} at {step}", flush=True))
print("ready", flush=True)
sys.stdin.readline()
for step, width in enumerate(widths.split(",")):
    for phase in PHASES:
        inj.point(phase, step)
        print(f"passed {step} {phase}", flush=True)
        if phase == "before-step":
            inj.at_width(int(width.rstrip("f")))
            if width.endswith("f"):
                inj.at_width(None)
print("done", flush=True)
"""


def _lives(spec: str, state: str, pids: list[str], widths: str = "4,4,4,4") -> dict[str, tuple[int, str]]:
    """Start one life per process id at once (all born before any fires), let them step; their
    exit codes and outputs."""
    procs = {pid: subprocess.Popen([PYTHON, "-c", WAITING_STEPPER, spec, pid, state, widths], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=clean_env()) for pid in pids}
    try:
        for p in procs.values():
            assert p.stdout.readline().strip() == "ready"
        for p in procs.values():
            p.stdin.write("go\n")
            p.stdin.flush()
        return {pid: (p.wait(timeout=60), p.stdout.read()) for pid, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_kill_all_kills_each_life_at_its_step_once_per_run(tmp_path):
    state = str(tmp_path / "faults")
    spec = "kill:process=0:step=1:phase=before-step;kill-all:step=2:phase=after-commit"
    first = _lives(spec, state, ["0", "1", "2"])
    assert first["0"][0] == -signal.SIGKILL and _passed(first["0"][1]) == _points_before(1, "before-step")
    for pid in ("1", "2"):  # the members of step 2 die there
        assert first[pid][0] == -signal.SIGKILL and _passed(first[pid][1]) == _points_before(2, "after-commit")
    # Lives begun after the job died at step 2 (process 0's restart, a cold restart) train through it.
    for pid in ("0", "1", "2"):
        code, out = _lives(spec, state, [pid])[pid]
        assert code == 0 and "fire" not in out, out
        assert _passed(out) == _all_points(4)


def test_width_rule_waits_for_a_step_of_that_width(tmp_path):
    spec = "kill:process=1:step=1:phase=before-step:width=4"
    assert parse_rule(spec).width == 4 and parse_rule(parse_rule(spec).spec) == parse_rule(spec)
    code, out = _lives(spec, str(tmp_path / "a"), ["1"], widths="4,3,3,4,4")["1"]
    # before step 1 the last step had 4 members: it fires there ...
    assert code == -signal.SIGKILL and _passed(out) == _points_before(1, "before-step"), out
    code, out = _lives(spec, str(tmp_path / "b"), ["1"], widths="3,3,3,4,4")["1"]
    # ... and here only before step 4, the first after a step of 4 members.
    assert code == -signal.SIGKILL and _passed(out) == _points_before(4, "before-step"), out
    code, out = _lives(spec, str(tmp_path / "c"), ["1"], widths="3,4f,3,3")["1"]
    # after a failed attempt the width is unknown until the next step is entered
    assert code == 0 and "fire" not in out, out
    # inside a step it is the step's own width
    code, out = _lives("kill-all:step=1:width=3", str(tmp_path / "d"), ["2"], widths="3,4,3,3")["2"]
    assert code == -signal.SIGKILL and _passed(out) == _points_before(2, "after-grad"), out


def test_stop_hangs_the_worker_at_its_step(tmp_path):
    state = str(tmp_path / "faults")
    spec = "stop:process=2:step=2:phase=before-step"
    with started([PYTHON, "-c", STEPPER, spec, "2", state, "5"], stdout=subprocess.PIPE, text=True) as proc:
        wait_for(lambda: is_stopped(proc.pid) or proc.poll() is not None, timeout=30,
                 what="the worker to stop itself")
        assert proc.poll() is None, "the worker exited instead of stopping"
        time.sleep(0.3)
        assert is_stopped(proc.pid), "the worker must stay stopped"
        proc.kill()  # SIGKILL works on a stopped process
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert _passed(out) == _points_before(2, "before-step"), out
    assert out.splitlines()[-1] == "fire stop:process=2:step=2:phase=before-step at 2"

    again = run_python(STEPPER, spec, "2", state, "5", timeout=60)
    assert again.returncode == 0, again.describe()
    assert "fire" not in again.stdout
    assert _passed(again.stdout) == _all_points(5)


def test_hang_and_new_phases_parse():
    from jaxft.faults import parse_rule

    r = parse_rule("hang:process=2:step=7:for=30s")
    assert (r.action, r.process, r.step, r.duration) == ("hang", 2, 7, 30.0)
    assert r.spec == "hang:process=2:step=7:phase=after-grad:for=30s"
    assert parse_rule("kill:process=1:step=3:phase=during-rehydrate").phase == "during-rehydrate"
    assert parse_rule("kill:process=1:step=10:phase=during-restore").phase == "during-restore"
    for bad, needle in [("hang:process=1:after=3s", "hang is step-triggered only"),
                        ("kill:process=1:step=3:for=2s", "only with hang"),
                        ("hang:process=1:step=3:for=-1s", "non-negative")]:
        with pytest.raises(FaultSpecError, match=needle):
            parse_rule(bad)


def test_quiet_at_says_whether_a_rule_of_this_process_can_fire_at_a_step(tmp_path):
    rules = parse_rules(["kill:process=1:step=5:phase=before-step", "kill:process=0:step=7",
                         "stop:process=1:step=20:width=2"])
    inj = FaultInjector(rules, process_id=1, state_dir=str(tmp_path))
    assert inj.quiet_at(4) and not inj.quiet_at(5) and inj.quiet_at(6)
    assert inj.quiet_at(7)  # process 0's rule
    assert inj.quiet_at(19) and not inj.quiet_at(20) and not inj.quiet_at(31)  # width=N: from step 20 on
    inj.point("before-step", 6)  # not step 5's: nothing fires
    assert not inj.quiet_at(5)
    assert claim(str(tmp_path), rules[0], 1)  # fired (as point() marks it): it never fires again
    assert inj.quiet_at(5) and not inj.quiet_at(20)

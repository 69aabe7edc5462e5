"""jaxft.Timeouts: one settings object from the CLI / initialize() down to every wait."""

import json

import pytest
from helpers import PYTHON, by_event, clean_env, events, launch, run_jaxft, run_python

import jaxft
from jaxft.core.rejoin import donor, is_new

pytestmark = pytest.mark.smoke


def test_defaults_and_updates():
    t = jaxft.Timeouts()
    assert (t.heartbeat, t.collective, t.reset, t.barrier) == (3, 5, 60, 600)
    u = t.updated(["reset=12", "save-barrier=7.5"])
    assert (u.reset, u.save_barrier, u.heartbeat) == (12, 7.5, 3)
    assert jaxft.Timeouts().updated(u.encode()) == u  # the environment round trip
    assert "Timeouts.reset=12 s" in u.describe("reset") and "--timeout reset=SECONDS" in u.describe("reset")


@pytest.mark.parametrize("spec, message", [
    (["nope=3"], "unknown timeout(s) ['nope']"),
    (["reset=abc"], "timeout reset='abc' is not a number"),
    (["reset"], "is not NAME=SECONDS"),
    (["reset=0"], "timeout reset must be > 0 seconds"),
    (["heartbeat=0.5"], "timeout heartbeat must be >= 1 second"),
])
def test_bad_settings_are_named(spec, message):
    with pytest.raises(jaxft.TimeoutsError) as e:
        jaxft.Timeouts().updated(spec)
    assert message in str(e.value)
    assert isinstance(e.value, jaxft.Error)


def test_from_env_shortcuts_win():
    env = {"JAXFT_TIMEOUTS": "heartbeat=4,reset=9", "JAXFT_COLLECTIVE_TIMEOUT": "8"}
    t = jaxft.Timeouts.from_env(env)
    assert (t.heartbeat, t.reset, t.collective) == (4, 9, 8)


def test_launch_rejects_a_bad_timeout_in_one_line():
    r = run_jaxft("launch", "-n", "1", "--timeout", "reset=-1", "--", PYTHON, "-c", "pass", timeout=30)
    assert r.returncode == 2, r.describe()
    assert r.stderr.strip() == "jaxft launch: error: timeout reset must be > 0 seconds, got -1.0", r.describe()


def test_launch_hands_the_timeouts_to_initialize(tmp_path):
    code = ("import jaxft, dataclasses; rt = jaxft.initialize(); "
            "from jaxft import timeouts; assert timeouts.current() == rt.timeouts; "
            "rt.events.log('settings', **dataclasses.asdict(rt.timeouts), hb=rt.heartbeat_timeout)")
    r = launch(1, [PYTHON, "-c", code], "--timeout", "reset=11", "--timeout", "barrier=90",
               "--heartbeat-timeout", "4", run_dir=tmp_path, timeout=60)
    assert r.returncode == 0, r.describe()
    (e,) = by_event(events(tmp_path), "settings")
    assert (e["reset"], e["barrier"], e["heartbeat"], e["hb"], e["collective"]) == (11, 90, 4, 4, 5), e


def test_initialize_takes_a_timeouts_object():
    code = """
import json, jaxft
rt = jaxft.initialize(timeouts=jaxft.Timeouts(reset=13.0, heartbeat=5, collective=6), environ={})
print(json.dumps([rt.timeouts.reset, rt.heartbeat_timeout, rt.collective_timeout]))
"""
    r = run_python(code, timeout=60, env=clean_env())
    assert r.returncode == 0, r.describe()
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [13.0, 5, 6]


def test_rejoin_detection_and_donor():
    assert is_new(None, {0: 1})
    assert not is_new({0: 1, 1: 1}, {0: 1})
    assert is_new({0: 1, 1: 1}, {0: 1, 1: 2})  # process 1 restarted
    assert donor({0: 5, 1: 7, 2: 7}) == 1
    assert donor({3: 2}) == 3

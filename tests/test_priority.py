"""jaxft.priority: a restarted worker sets up niced and gives every thread the launcher's
priority back as it joins (real processes and threads, no jax)."""

import os

import pytest
from helpers import run_python

from jaxft import priority

CHILD = r'''
import os, threading, time
from jaxft import priority
os.environ[priority.BASE_NICE] = str(int(os.environ["BASE"]))
priority.start_niced(int(os.environ["NICE"]))          # as the launcher's preexec does
stop = threading.Event()
workers = [threading.Thread(target=stop.wait) for _ in range(3)]  # started niced, like XLA's pools
for t in workers: t.start()
tids = [int(t) for t in os.listdir("/proc/self/task")]
print("before", sorted({os.getpriority(os.PRIO_PROCESS, t) for t in tids}))
print("restored", priority.restore(), "again", priority.restore())
print("after", sorted({os.getpriority(os.PRIO_PROCESS, t) for t in tids}))
stop.set()
'''


@pytest.mark.skipif(not hasattr(os, "setpriority") or not os.path.isdir("/proc/self/task"), reason="Linux only")
def test_a_niced_restart_restores_every_thread_as_it_joins():
    nice = priority.lowered_nice(priority.SETUP_NICE)
    if nice is None:
        pytest.skip("this user could not undo a lowered priority (not root, RLIMIT_NICE too small)")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert nice == min(19, base + priority.SETUP_NICE)
    env = dict(os.environ, BASE=str(base), NICE=str(nice))
    r = run_python(CHILD, env=env)
    assert r.returncode == 0, r.describe()
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert lines["before"] == f"[{nice}]", r.stdout
    assert lines["restored"] == "True again False", r.stdout  # once: the variable is consumed
    assert lines["after"] == f"[{base}]", r.stdout


def test_off_unless_asked():
    assert priority.lowered_nice(0) is None  # jaxft launch's default: --nice-restarts 0


def test_nothing_to_restore_without_the_launchers_variable(monkeypatch):
    monkeypatch.delenv(priority.BASE_NICE, raising=False)
    assert priority.restore() is False

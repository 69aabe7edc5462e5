"""A barrier over a member map gives up on a member whose life in the map is over (jaxft.worker.lives).

Real processes under ``jaxft launch``, a real coordination service, a real SIGKILL: the member
dies after the map was agreed and before it reaches the barrier, so no arrival key ever names
its heartbeat; the barrier knew of it only by process id and waited out its 60 s bound (the
data-plane rebuild in `test_rejoin.py::test_two_join_at_once_and_one_dies_as_they_join`).
"""

import pytest
from helpers import PYTHON, REPO, by_event, clean_env, events, launch

WORKER = str(REPO / "tests" / "workers" / "lives.py")


@pytest.mark.parametrize("mode, restart, why", [
    ("records", "never", "the launcher recorded process 1's exit"),
    ("retired", "never", "process 1's launcher saw it exit (it retired that life in the service)"),
    pytest.param("restart", "on-failure", "process 1 restarted", marks=pytest.mark.smoke),
    ("heartbeat", "never", "process 1 stopped heartbeating"),
])
def test_a_rebuild_barrier_gives_up_on_a_member_that_died_before_it(tmp_path, mode, restart, why):
    # (records: no retirement, whose record comes before the death record and says the same)
    env = clean_env(JAXFT_RETIRE_LIVES="0") if mode == "records" else None
    r = launch(2, [PYTHON, WORKER, mode], "--restart", restart, "--heartbeat-timeout", "3",
               run_dir=tmp_path, timeout=120, env=env)
    (b,) = by_event(events(tmp_path), "barrier")
    assert b["outcome"].startswith("BarrierAbandoned") and why in b["outcome"], (b, r.describe())
    if restart == "on-failure":
        assert r.returncode == 0, r.describe()

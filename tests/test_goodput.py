"""Goodput accounting: the buckets add up to the wall time and land where they belong."""

import pytest

from jaxft.goodput import BUCKETS, goodput


def _ev(t, event, **fields):
    return {"time": float(t), "event": event, "process": fields.pop("process", 0), "incarnation": 0, **fields}


def test_buckets_add_up_and_redone_steps_are_wasted():
    ev = [_ev(0, "run_start", process="launcher")]
    ev += [_ev(10 + s, "commit", step=s, members=[0, 1]) for s in range(6)]  # steps 0..5, 1 s each
    ev += [_ev(12.5, "checkpoint_started", step=3, blocking_ms=200.0)]
    ev += [_ev(15.5, "fault", action="kill-all", step=6), _ev(15.6, "exit", signal="SIGKILL"),
           _ev(18.0, "restored", step=4, seconds=0.5)]
    ev += [_ev(20 + i, "commit", step=s, members=[0, 1]) for i, s in enumerate(range(4, 10))]  # 4, 5 redone
    ev += [_ev(27, "run_end", process="launcher")]
    g = goodput(ev)
    assert g["wall_s"] == 27.0
    assert sum(g[b] for b in BUCKETS) == pytest.approx(g["wall_s"], rel=0.01)
    assert g["startup"] == pytest.approx(10.0) and g["shutdown"] == pytest.approx(2.0)
    # 5 + 4 new steps of 1 s (the first after the restart counts 1 s), less the 0.2 s save
    assert g["productive"] == pytest.approx(9 - 0.2) and g["checkpoint_save"] == pytest.approx(0.2)
    assert g["wasted"] == pytest.approx(2.0)  # steps 4 (1 s of its 5 s piece) and 5, computed again
    assert g["checkpoint_restore"] == pytest.approx(0.5)
    assert g["recovery"] == pytest.approx(4.0 - 0.5)  # the rest of the 5 s piece, less the restore

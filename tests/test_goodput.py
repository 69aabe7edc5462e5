"""Goodput accounting: the buckets add up to the wall time and land where they belong."""

import pytest

from jaxft.supervisor.goodput import BUCKETS, goodput


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


def test_report_compares_two_runs_side_by_side(tmp_path):
    """`jaxft report A B`: both runs' goodput in one table and one picture."""
    import json

    from helpers import run_jaxft

    def run(name: str, redo: bool) -> str:
        d = tmp_path / name
        d.mkdir()
        t = 1000.0
        ev = [{"time": t, "event": "run_start", "process": "launcher", "incarnation": 0}]
        for step in range(6):
            t += 1.0
            ev.append({"time": t, "event": "commit", "process": 0, "incarnation": 0, "step": step, "members": [0],
                       "loss": 1.0})
            if redo and step == 3:  # the step is computed again after a failure
                t += 2.0
                ev.append({"time": t, "event": "commit", "process": 0, "incarnation": 1, "step": step,
                           "members": [0], "loss": 1.0})
        ev.append({"time": t + 1, "event": "run_end", "process": "launcher", "incarnation": 0})
        (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
        return str(d)

    a, b = run("steady", False), run("redone", True)
    r = run_jaxft("report", a, b, "--json", timeout=120)
    assert r.returncode == 0, r.describe()
    out = json.loads(r.stdout)
    assert set(out["runs"]) == {"steady", "redone"}, out.keys()
    assert out["runs"]["redone"]["goodput"]["wall_s"] > out["runs"]["steady"]["goodput"]["wall_s"]
    assert (tmp_path / "steady" / "compare.png").stat().st_size > 0


def test_the_chaos_figures_compare_params_leaf_by_leaf_and_check_the_finals_agree():
    import numpy as np

    from jaxft.bench.chaos import params_diff, run_figures

    ref = {"w": np.array([1.0, 2.0, 3.0], np.float32), "b": np.array([4.0], np.float32)}
    assert params_diff(dict(ref), ref) == {"bitwise_equal": True, "max_rel_diff_per_leaf": 0.0}
    permuted = {"w": ref["w"][::-1].copy(), "b": ref["b"]}  # the same norm: a norm check would pass it
    d = params_diff(permuted, ref)
    assert not d["bitwise_equal"] and d["max_rel_diff_per_leaf"] > 0.5
    nudged = {"w": ref["w"], "b": np.nextafter(ref["b"], np.float32(5))}
    d = params_diff(nudged, ref)
    assert not d["bitwise_equal"] and 0 < d["max_rel_diff_per_leaf"] < 1e-6
    ev = [_ev(s, "commit", step=s, members=[0, 1], process=p) for s in range(3) for p in (0, 1)]
    same = ev + [_ev(3, "final", params_sha256="aa", process=p) for p in (0, 1)]
    assert run_figures(same, 3)["finals_agree"]
    split = ev + [_ev(3, "final", params_sha256=h, process=p) for p, h in ((0, "aa"), (1, "bb"))]
    assert not run_figures(split, 3)["finals_agree"]

"""jaxft.worker.kv.KVBarrier: one outcome per barrier instance, with real processes and a real
coordination service (``jaxft launch``)."""

from helpers import PYTHON, REPO, by_event, events, launch

WORKER = str(REPO / "tests" / "workers" / "barrier_agree.py")


def test_a_member_that_arrived_and_gave_up_takes_the_late_arrival_with_it(tmp_path):
    # Process 1 arrived, then gave up (cancel set); process 0 arrived after that and found
    # every arrival key present. It used to pass while process 1 was abandoned: the two then
    # disagreed on whether the data plane is rebuilt, and the next step waited 60 s.
    r = launch(2, [PYTHON, WORKER], run_dir=tmp_path, timeout=120)
    assert r.returncode == 0, r.describe()
    logged = {e["process"]: e for e in by_event(events(tmp_path), "barrier")}
    assert sorted(logged) == [0, 1], r.describe()
    outcomes = {p: e["outcome"] for p, e in logged.items()}
    assert len({o.split(":")[0] for o in outcomes.values()}) == 1, f"the members disagree: {outcomes}"
    assert all(o.startswith("BarrierAbandoned") for o in outcomes.values()), outcomes
    assert "process 1 gave up" in outcomes[0], outcomes  # the reason of the member that decided
    # a barrier every member reached passes everywhere; its decision key goes with the namespace
    assert {e["second"] for e in logged.values()} == {"passed"}, logged
    assert {e["decision"] for e in logged.values()} == {"pass"}, logged
    assert logged[0]["left"] == [], logged

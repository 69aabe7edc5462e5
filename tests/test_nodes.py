"""The node plan of ``jaxft slurm`` (:class:`jaxft.supervisor.nodes.NodePlan`), in-process:
which node runs which rank, a lost node replaced by a spare or by itself once back, and when
the job ends. The real scheduler runs are in ``tests/test_slurm.py``."""

from __future__ import annotations

import pytest

from jaxft.supervisor.nodes import End, Lost, NodePlan, PlanOptions, Start, Stop, Why

OPTS = PlanOptions(node_timeout_s=5, start_timeout_s=20, retry_s=3, max_replacements=2)


def _running(plan: NodePlan, now: float = 0.0) -> None:
    for r, a in plan.agents.items():
        plan.beat(r, a.generation, "1", now)


def test_ranks_on_the_first_nodes_and_the_rest_spares():
    plan = NodePlan(["b", "n1", "n2", "n3"], spares=1, options=OPTS)
    assert plan.start(0.0) == [Start(0, "b", 0, Why.FIRST), Start(1, "n1", 0, Why.FIRST), Start(2, "n2", 0, Why.FIRST)]
    assert plan.spares == ["n3"] and plan.ranks == 3


@pytest.mark.parametrize("spares,nodes", [(2, ["a", "b"]), (-1, ["a"])])
def test_bad_spares(spares, nodes):
    with pytest.raises(ValueError):
        NodePlan(nodes, spares=spares)


def test_silent_node_lost_and_a_spare_takes_its_rank():
    plan = NodePlan(["b", "n1", "s"], spares=1, options=OPTS)
    plan.start(0.0)
    _running(plan, 1.0)
    plan.beat(0, 0, "2", 5.0)  # rank 0 beats on; rank 1 falls silent after t=1
    assert plan.tick(5.5) == []
    actions = plan.tick(6.5)
    assert actions[:2] == [Stop(1, 0), Lost(1, "n1", "no heartbeat for 5.5 s")]
    assert actions[2] == Start(1, "s", 1, Why.SPARE)
    assert plan.agents[1].node == "s" and not plan.waiting


def test_without_a_spare_the_lost_node_is_tried_again_once_back():
    plan = NodePlan(["b", "n1"], spares=0, options=OPTS)
    plan.start(0.0)
    _running(plan, 1.0)
    plan.beat(0, 0, "2", 7.0)
    assert [type(a) for a in plan.tick(7.0)] == [Stop, Lost]
    assert plan.waiting == {1}
    assert plan.tick(9.0) == []  # retry_s not over
    assert plan.tick(10.5, down={"n1"}) == []  # SLURM says it is down
    assert plan.tick(10.6) == [Start(1, "n1", 1, Why.RETURNED)]
    # the new agent never beats: lost again, tried again later, until max_replacements
    for t, expected in ((31.0, [Stop, Lost]), (34.5, [Start]), (55.0, [Stop, Lost]), (58.5, [End])):
        plan.beat(0, 0, str(t), t)  # rank 0 beats on
        actions = plan.tick(t)
        assert [type(a) for a in actions] == expected, (t, actions)
    assert actions == [End(1, "rank 1 lost its agent 3 times")]


def test_an_agent_that_ended_by_itself_is_done_and_the_job_ends_when_all_have():
    plan = NodePlan(["b", "n1"], spares=0, options=OPTS)
    plan.start(0.0)
    _running(plan)
    plan.beat(1, 0, "exit 0", 10.0)
    assert plan.exited(1, 0, 10.0) == []
    assert plan.tick(30.0) == [Stop(0, 0), Lost(0, "b", "no heartbeat for 30.0 s"), End(0, "training ended")]


def test_srun_ended_without_the_last_word_loses_the_node():
    plan = NodePlan(["b", "n1", "s"], spares=1, options=OPTS)
    plan.start(0.0)
    _running(plan)
    assert plan.exited(1, 0, 2.0) == [Lost(1, "n1", "its srun ended without the agent's last word")]
    assert plan.tick(2.1) == [Start(1, "s", 1, Why.SPARE)]


def test_once_training_ended_a_lost_rank_is_not_replaced():
    plan = NodePlan(["b", "n1", "s"], spares=1, options=OPTS)
    plan.start(0.0)
    _running(plan)
    plan.beat(0, 0, "exit 0", 3.0)
    plan.exited(0, 0, 3.0)
    actions = plan.tick(9.0)
    assert Start not in {type(a) for a in actions} and actions[-1] == End(0, "training ended")


def test_an_agent_error_ends_the_job_with_an_error():
    plan = NodePlan(["b", "n1"], spares=0, options=OPTS)
    plan.start(0.0)
    _running(plan)
    for r in (0, 1):
        plan.beat(r, 0, "exit 1" if r else "exit 0", 2.0)
        out = plan.exited(r, 0, 2.0)
    assert out == [End(1, "agents ended with errors (rank 1: 1)")]


def test_a_stale_generation_is_ignored():
    plan = NodePlan(["b", "n1", "s"], spares=1, options=OPTS)
    plan.start(0.0)
    _running(plan)
    plan.exited(1, 0, 1.0)
    plan.tick(1.0)  # generation 1 on the spare
    assert plan.exited(1, 0, 2.0) == [] and plan.beat(1, 0, "exit 0", 2.0) == []
    assert plan.agents[1].generation == 1


def test_an_agents_heartbeat_file_counts_then_says_its_exit(tmp_path):
    from jaxft import protocol
    from jaxft.supervisor.launcher import BEAT_EVERY_S, AgentBeat

    path = str(tmp_path / "nodes" / "rank1.g0")
    beat = AgentBeat(path)
    beat.tick(100.0)
    assert protocol.read_beat(path) == "1"
    beat.tick(100.0 + BEAT_EVERY_S / 2)  # not due yet
    assert protocol.read_beat(path) == "1"
    beat.tick(100.0 + BEAT_EVERY_S)
    assert protocol.read_beat(path) == "2"
    beat.last(143)
    assert protocol.read_beat(path) == "exit 143"
    AgentBeat(None).tick(0.0)  # outside jaxft slurm: nothing written, nothing raised


def test_jaxft_slurm_outside_a_job_says_so(tmp_path):
    import subprocess
    import sys

    from helpers import clean_env

    env = {k: v for k, v in clean_env().items() if not k.startswith("SLURM_")}
    r = subprocess.run([sys.executable, "-m", "jaxft.cli", "slurm", "-n", "2", "--", "true"], env=env,
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and "jaxft slurm runs inside a SLURM batch job" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "jaxft.cli", "slurm", "-n", "2"], env={**env, "SLURM_JOB_ID": "7",
                       "SLURM_JOB_NODELIST": "a"}, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and "no worker command" in r.stderr, r.stderr

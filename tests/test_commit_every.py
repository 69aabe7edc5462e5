"""``commit_every``: one commit query per N steps, all of them or none committed. Real
processes, a real coordination service, real SIGKILL.

The exact reduction makes a step's bits independent of the width, so every run here must
end with the one-process run's ``params_sha256`` (each step committed once, by one commit
query every 4 steps or by one each)."""

import json
import os

import pytest
from helpers import (
    EXACT,
    MLP,
    PYTHON,
    check_agreed_run,
    commits_by_step,
    finals,
    run_jaxft,
    run_python,
    stop_with_checkpoint,
    summary,
    train,
)
from helpers import by_event as of

STEPS = 30
EVERY = ("--commit_every", "4")


@pytest.fixture(scope="module")
def sequential_runs(one_process_exact):
    """``steps -> params_sha256`` of the one-process run with a commit per step."""
    return one_process_exact


@pytest.fixture
def sequential(sequential_runs):
    return sequential_runs(STEPS)


def deferred_steps(steps: int, every: int) -> list[int]:
    """The steps of a fault-free run that leave their commit to a later one: all but each
    N-th, the first (the members are new) and the last (the run's end)."""
    return [k for k in range(1, steps - 1) if (k + 1) % every]


def test_a_run_with_a_commit_every_4_steps_computes_the_same(sequential, tmp_path):
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), *EXACT, *EVERY, n=2)
    assert proc.returncode == 0, proc.describe()
    check_agreed_run(events, STEPS, 2)
    for f in finals(events):
        assert f["params_sha256"] == sequential
        assert (f["deferred"], f["rolled_back"]) == (len(deferred_steps(STEPS, 4)), 0), f
    # each commit's steps are logged when its query answered: in order, each once per process
    for p in (0, 1):
        assert [e["step"] for e in of(events, "commit", process=p)] == list(range(STEPS))


def test_a_failure_undoes_the_steps_since_the_last_commit_everywhere(sequential, tmp_path):
    # Every member ran steps 8 and 9, leaving their commit to step 11's query; process 2 is
    # killed before step 10, whose collective then fails on the others: steps 8 and 9 are
    # undone on both and run again at width 2.
    faults = ["kill:process=2:step=10:phase=before-step"]
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), *EXACT, *EVERY, faults=faults)
    assert proc.returncode == 1, proc.describe()  # process 2 died and was not restarted
    for p in (0, 1):
        (rb,) = of(events, "rolled_back", process=p)
        assert (rb["step"], rb["steps"]) == (8, [8, 9]), rb
        assert [e["step"] for e in of(events, "commit", process=p)] == list(range(STEPS)), "each step once"
        assert [e["step"] for e in of(events, "step_failed", process=p)] == [10]
    for step, commits in commits_by_step(events).items():
        members = {tuple(c["members"]) for c in commits}
        assert members == ({(0, 1, 2)} if step < 8 else {(0, 1)}), f"step {step}: {members}"
    survivors = finals(events)
    assert sorted(f["process"] for f in survivors) == [0, 1]
    assert {f["params_sha256"] for f in survivors} == {sequential}, "the undone steps ran again: the same bits"
    assert all(f["rolled_back"] == 2 for f in survivors), survivors


@pytest.mark.soak  # time budget (23 s): the default suite keeps a kill under the default batching
def test_a_restarted_member_rejoins_a_pipelined_run_with_a_commit_every_4_steps(sequential_runs, tmp_path):
    # A kill inside step 6's program: the survivors undo steps 4 and 5 (run, not committed)
    # and go on at width 2; the restarted process is admitted at a commit of its own and
    # rehydrated from a member's committed state. With the pipeline too (the two opt-ins of
    # the fast step path together; test_pipeline's own rejoin is in the soak): no early
    # program crosses the failure or the admission, and the bits are the sequential run's.
    steps = 100  # (0.1 s a step: the restarted process has ~10 s to set up)
    sequential = sequential_runs(steps)
    faults = ["kill:process=1:step=6:phase=in-step"]
    proc, events = train(tmp_path, MLP, "--steps", str(steps), *EXACT, *EVERY, "--pipeline", "--step_sleep", "0.1",
                         faults=faults, restart="on-failure")
    assert proc.returncode == 0, proc.describe()
    for p in (0, 2):
        assert [(e["step"], e["steps"]) for e in of(events, "rolled_back", process=p)] == [(4, [4, 5])]
    (rehydrated,) = of(events, "rehydrated")
    assert rehydrated["process"] == 1, rehydrated
    fs = finals(events)
    assert sorted(f["process"] for f in fs) == [0, 1, 2], fs
    assert {f["params_sha256"] for f in fs} == {sequential}, fs
    assert all(f["deferred"] > 0 for f in fs), fs  # (the joiner too, after its admission)
    assert all(f["started_early"] > 0 for f in fs if f["process"] != 1), fs
    commits = commits_by_step(events)
    assert sorted(commits) == list(range(steps))
    for step, cs in commits.items():
        assert len({tuple(c["members"]) for c in cs}) == 1, f"step {step}: members disagree"
    assert {tuple(c["members"]) for c in commits[steps - 1]} == {(0, 1, 2)}, "the run ends at full width"


def test_checkpoints_every_8_steps_are_saved_at_the_commits(tmp_path):
    proc, events = train(tmp_path, MLP, "--steps", "20", "--hidden", "16", *EVERY, "--checkpoint_every", "8", n=2)
    assert proc.returncode == 0, proc.describe()
    saved = {(e["process"], e["step"]) for e in of(events, "checkpoint_saved")}
    assert saved == {(p, s) for p in (0, 1) for s in (8, 16)}, saved


def test_checkpoints_between_commits_are_a_configuration_error_before_training(tmp_path):
    # Before: a ValueError at the first commit, and --restart on-failure restarted both
    # processes again and again (each life committed a step, so no crash-loop guard either).
    # Now restore() refuses it before any step: exit 78, one line, no restart.
    proc, events = train(tmp_path, MLP, "--steps", "20", "--hidden", "16", *EVERY, "--checkpoint_every", "6",
                         n=2, restart="on-failure", extra=["--max-restarts", "2"], timeout=180)
    out = proc.stdout + proc.stderr
    assert summary(tmp_path)["restarts"] == {"0": 0, "1": 0}, proc.describe()
    assert {e.get("code") for e in summary(tmp_path)["exits"]} == {78}, proc.describe()
    assert proc.returncode == 1 and "Traceback" not in out, proc.describe()
    line = "ElasticCheckpointer every=6 is not a multiple of the loop's commit_every=4"
    assert out.count(line) == 2, proc.describe()  # one line from each process
    assert not of(events, "commit") and not of(events, "checkpoint_saved")


def test_checkpoints_between_commits_are_refused_at_the_first_commit_without_restore(tmp_path):
    # A program that never calls restore() meets the same ConfigError in on_commit.
    import types

    import jaxft

    ckpt = jaxft.ElasticCheckpointer(tmp_path / "ck", options=jaxft.CheckpointOptions(every=6))
    record = types.SimpleNamespace(members=(0,), incarnations={0: 0}, step=3)
    with pytest.raises(jaxft.ConfigError, match="every=6 is not a multiple of the loop's commit_every=4"):
        ckpt.on_commit(types.SimpleNamespace(options=jaxft.LoopOptions(commit_every=4), step=4), record)


SAVE_PENDING = r"""
import json, os, sys
import optax, jaxft
from jaxft.bench import mlp
rt = jaxft.initialize()
data = jaxft.GlobalBatches(mlp.make_dataset(256), 32, seed=0)
ckpt = jaxft.ElasticCheckpointer(os.path.join(sys.argv[1], "ck"), runtime=rt)
trainer = jaxft.ElasticTrainer(mlp.loss_fn, optax.sgd(0.1), mlp.init_params(0, 16, 8), data, runtime=rt,
                               on_commit=ckpt.on_commit, options=jaxft.LoopOptions(commit_every=4))
tried = []

def save_between_commits():  # before each attempt: the first time a step is pending, save
    if trainer.loop.pending and not tried:
        out = {"step": trainer.loop.step, "pending": trainer.loop.pending, "raised": None}
        try:
            ckpt.save(trainer)
        except jaxft.CheckpointError as e:
            out.update(raised=type(e).__name__, config=isinstance(e, jaxft.ConfigError), message=str(e))
        tried.append(out)

trainer.loop.run(8, before_attempt=save_between_commits)
ckpt.close()
print(json.dumps(tried))
"""


def test_saving_steps_not_committed_yet_is_refused(tmp_path):
    # Before: save() wrote checkpoint 2 of a state whose step 1 was run but not committed.
    r = run_python(SAVE_PENDING, str(tmp_path), timeout=120)
    assert r.returncode == 0, r.describe()
    (out,) = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["step"], out["pending"]) == (2, 1), out  # step 0 committed alone, step 1 ran and waits
    assert (out["raised"], out.get("config")) == ("UncommittedSave", True), out
    assert out["message"] == ("save() at step 2: its last 1 steps are not committed yet (commit_every=4) "
                              "and may be undone; save from on_commit or after run()"), out
    assert not (tmp_path / "ck").exists() or not os.listdir(tmp_path / "ck"), os.listdir(tmp_path / "ck")


def test_a_stop_ends_a_run_with_a_commit_every_4_steps_at_one_step_with_its_checkpoint(tmp_path, marker):
    # SIGTERM: the member asked to stop makes every step commit alone from then on (its vote),
    # so the agreed stop step is a commit on every member
    worker = [PYTHON, MLP, "--steps", "400", "--step_sleep", "0.05", "--checkpoint_every", "1000", "--hidden", "16",
              *EVERY, marker]
    ev, _ = stop_with_checkpoint(tmp_path / "run", worker)
    assert not of(ev, "hung") and not of(ev, "abandoned"), ev


@pytest.mark.parametrize("args, message", [
    (("overhead", "--commit-every", "0"), "--commit-every must be auto or an int >= 1, got 0"),
    (("chaos", "--commit-every", "3"), "--commit-every 3: must be auto, or >= 1 and divide --checkpoint-every 20"),
])
def test_the_benches_refuse_a_bad_commit_every_in_one_line(args, message):
    r = run_jaxft("bench", *args, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.describe()
    assert f"jaxft bench: error: {message}" in r.stderr, r.describe()


# -- commit_every="auto" (the default) ------------------------------------------------------

def test_auto_batches_short_steps_only_where_a_query_is_a_share_of_the_step():
    from jaxft.core import batching

    # a ~1 ms query: 13 ms steps batch the most, 0.1 s steps (2 % at most) do not, nor 1 s ones
    assert batching.commit_every(0.013, 0.001, 1 / 600) == batching.MAX_STEPS
    assert batching.commit_every(0.1, 0.001, 1 / 600) == 1
    assert batching.commit_every(1.0, 0.001, 1 / 600) == 1
    # 40 ms steps: at most MAX_UNDO_S of training undone by a failure
    assert batching.commit_every(0.04, 0.001, 1 / 600) == int(batching.MAX_UNDO_S / 0.04)
    # frequent failures batch less: sqrt(2 q / (f s^2))
    assert batching.commit_every(0.013, 0.001, 1.0) == 3
    assert batching.commit_every(0.013, 0.001, 10.0) == 1
    assert batching.memory_allows(10, None) and batching.memory_allows(10, 100)
    assert not batching.memory_allows(11, 100)


def test_auto_measures_before_it_batches_and_counts_failures():
    from jaxft.core import batching

    b = batching.CommitBatcher(now=0.0)
    t = 0.0
    for _ in range(batching.WARMUP_STEPS):  # 10 ms steps, 1 ms queries
        t += 0.01
        b.ran(t)
        b.committed(0.001)
        assert b.size(t) == 1  # still measuring
    t += 0.01
    b.ran(t)
    assert b.size(t) == batching.MAX_STEPS
    assert not b.commit_now(pending=batching.MAX_STEPS - 2, now=t)
    assert b.commit_now(pending=batching.MAX_STEPS - 1, now=t)
    for _ in range(600):  # one failure a second over the prior's 600 s: less batching
        b.failed()
    assert b.size(t) == int((2 * 0.001 / (601 / (t + batching.PRIOR_FAILURE_S) * 0.01 ** 2)) ** 0.5) == 4
    for _ in range(20000):  # failures all the time: batching no longer pays
        b.failed()
    assert b.size(t) == 1
    b = batching.CommitBatcher(now=0.0, memory_ok=False)  # a state too big for one more copy
    for k in range(40):
        b.ran(0.01 * k)
        b.committed(0.001)
    assert b.size(0.4) == 1


def test_auto_counts_the_time_inside_step_attempts_only():
    # 10 ms steps in blocks of 10, with 0.2 s of the caller's own work between blocks, outside
    # try_step (an evaluation; the overhead bench's plain loop): a 0.5 ms query is 5 % of the
    # step, so it batches. Counted, those pauses made a step look like 31 ms, where the query is
    # under MIN_SHARE: the bench's default batched 44-77 of its 100 steps (session 34).
    from jaxft.core import batching

    def measured(outside: bool, hook_s: float = 0.0) -> int:
        b = batching.CommitBatcher(now=0.0)
        t = 0.0
        for k in range(60):
            b.entered(t)
            t += 0.01
            b.ran(t)
            b.committed(0.0005)
            t += hook_s  # an on_commit hook: inside the attempt, a step's cost
            b.left(t)
            if k % 10 == 9:
                t += 0.2 if outside else 0.0
        return b.size(t)

    assert batching.commit_every(0.031, 0.0005, 1 / 600) == 1  # (the pauses counted)
    assert measured(outside=True) == measured(outside=False) > 1
    # Work in the attempt counts, however it is spread: a workload that sleeps 0.1 s a step in
    # on_commit (the mlp's --step_sleep) is a 0.11 s step; not a 10 ms one to batch 16 of
    assert measured(outside=False, hook_s=0.1) == 1


def test_auto_ends_a_batch_before_a_step_where_a_fault_rule_of_its_own_may_fire():
    from jaxft.core import step as step_core

    def votes(batch_full, next_quiet=True, commit_every=1):
        return step_core.own_votes(20, 100, pipeline=False, next_quiet=next_quiet, commit_every=commit_every,
                                   stop_requested=False, batch_full=batch_full)

    assert not votes(False).commit
    assert votes(True).commit
    assert votes(False, next_quiet=False).commit  # (a fixed commit_every keeps its steps: the rule undoes them)
    assert not votes(None, next_quiet=False, commit_every=4).commit
    assert votes(None, commit_every=3).commit  # (step 20: the 21st, a multiple of 3)


def test_a_run_with_the_default_batching_computes_the_same_with_a_kill_and_checkpoints(sequential, tmp_path):
    # commit_every="auto" (the default): the first 16 steps commit alone while the members
    # measure; then short steps batch. Process 2's rule kills it before step 24: its vote
    # commits step 23 alone, so no step is undone, as without batching. The checkpoints every
    # 10 steps commit alone too, and are saved at 10, 20 and 30.
    faults = ["kill:process=2:step=24:phase=before-step"]
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), *EXACT, "--checkpoint_every", "10", faults=faults)
    assert proc.returncode == 1, proc.describe()  # process 2 died and was not restarted
    survivors = finals(events)
    assert sorted(f["process"] for f in survivors) == [0, 1]
    assert {f["params_sha256"] for f in survivors} == {sequential}, survivors
    for f in survivors:
        assert f["deferred"] > 0 and f["rolled_back"] == 0, f
    assert not of(events, "rolled_back")
    for p in (0, 1):
        assert [e["step"] for e in of(events, "commit", process=p)] == list(range(STEPS)), "each step once"
        assert [e["step"] for e in of(events, "step_failed", process=p)] == [24]
        assert {e["step"] for e in of(events, "checkpoint_saved", process=p)} == {10, 20, 30}
    for step, commits in commits_by_step(events).items():
        members = {tuple(c["members"]) for c in commits}
        assert members == ({(0, 1, 2)} if step < 24 else {(0, 1)}), f"step {step}: {members}"

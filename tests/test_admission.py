"""Ready admission: the members keep training while a restarted process sets up; it enters
at a step every member agreed on, and the run computes what the fault-free run computes."""

from pathlib import Path

import numpy as np
import pytest
from helpers import EXACT, MLP, commits_by_step, finals, free_port, run_python, train
from helpers import by_event as of

from jaxft.protocol import RESTART_GAP_S

STEPS = 120


def load(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    # one process: the exact reduction's bits do not depend on the width (test_exact.py), and
    # each test below compares processes that trained at 2, 3 and 4 against these
    proc, events = train(d, MLP, "--steps", str(STEPS), "--admission", "ready", *EXACT,
                         "--final_params", str(d / "final"), n=1)
    assert proc.returncode == 0, proc.describe()
    return load(d / "final" / "final-p0.npz")


@pytest.mark.soak  # test_a_kill_during_the_first_step_then_rejoin checks the same in the default suite
def test_members_train_on_while_a_restarted_process_sets_up(reference, tmp_path):
    out = tmp_path / "final"
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), "--admission", "ready", "--check_every", "5",
                         "--step_sleep", "0.1", *EXACT, "--final_params", str(out),
                         faults=["kill:process=1:step=10:phase=before-step"], restart="on-failure")
    why = proc.describe()
    assert proc.returncode == 0, why
    f = finals(events)
    assert sorted(e["process"] for e in f) == [0, 1, 2], why
    assert len({e["params_sha256"] for e in f}) == 1, "members must end bitwise identical"
    by_step = commits_by_step(events)
    assert sorted(by_step) == list(range(STEPS))
    for step, commits in by_step.items():
        assert len({tuple(c["members"]) for c in commits}) == 1, f"step {step}: members disagree"
        assert sorted(c["process"] for c in commits) == list(commits[0]["members"]), step

    # The survivors committed steps without process 1 while it restarted and set up ...
    narrow = [s for s, c in by_step.items() if c[0]["members"] == [0, 2]]
    assert narrow and min(narrow) == 10, narrow
    # ... every member admitted it at the same step, and it entered exactly there.
    admits = of(events, "admit")
    assert sorted(a["process"] for a in admits) == [0, 2] and len({a["step"] for a in admits}) == 1, admits
    entered = admits[0]["step"]
    assert admits[0]["joiners"] == [1]
    assert by_step[entered][0]["members"] == [0, 1, 2] and by_step[entered - 1][0]["members"] == [0, 2]
    [rehydrated] = of(events, "rehydrated")
    assert rehydrated["process"] == 1 and rehydrated["step"] == entered
    assert by_step[STEPS - 1][0]["members"] == [0, 1, 2]

    # The same math as the fault-free run, to the bit, although some steps ran on 2 devices
    # (the exact reduction sums fixed chunks in a fixed order whatever the width).
    assert_bitwise(load(out / "final-p0.npz"), reference)


def assert_bitwise(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), (
            k, float(np.max(np.abs(got[k] - want[k]))))


def killed_and_restarted(tmp_path, fault: str, n: int, step_sleep: float, *worker_flags: str,
                         reduction: tuple[str, ...] = EXACT, launch_flags: tuple[str, ...] = ()):
    """A ready-admission run of ``n`` processes with ``fault``, restarted on failure; checks
    that all ``n`` finish with identical params and returns (events, description, params dir)."""
    out = tmp_path / "final"
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), "--admission", "ready", "--step_sleep", str(step_sleep),
                         *reduction, "--final_params", str(out), *worker_flags, n=n, restart="on-failure",
                         faults=[fault], extra=["--timeout", "reset=30", *launch_flags])
    why = proc.describe()
    assert proc.returncode == 0, why
    f = finals(events)
    assert sorted(e["process"] for e in f) == list(range(n)), why
    assert len({e["params_sha256"] for e in f}) == 1, why
    return events, why, out


@pytest.mark.soak  # time budget: test_hang's member stuck in a step whose member died (4 processes, ready
# admission, a kill inside a step, both rejoin, params agree) covers it in the default suite
def test_kill_inside_the_all_reduce_of_four_then_rejoin(reference, tmp_path):
    # Process 1 dies inside step 15 while the others are in its all-reduce. In a ring of four,
    # process 3 is no neighbour of 1: it used to wait out the collective timeout (5 s), and by
    # then process 1's restart had connected again, so the members' abandoned liveness query
    # stayed open in the service; the restart's first query completed it alone and the
    # members' next one waited for it for ever (a deadlock). Now the neighbours' failed
    # collective breaks the ring at once (jaxft.worker.breaker) and an abandoned query is reused.
    events, why, out = killed_and_restarted(tmp_path, "kill:process=1:step=15:phase=in-step", n=4, step_sleep=0.05)
    failed = of(events, "step_failed", step=15)
    assert sorted(e["process"] for e in failed) == [0, 2, 3], why
    assert all("Gloo" in e["cause"] for e in failed), failed  # left the all-reduce, not a barrier timeout
    by_step = commits_by_step(events)
    assert by_step[15][0]["members"] == [0, 2, 3] and by_step[STEPS - 1][0]["members"] == [0, 1, 2, 3], why
    # The survivors retried step 15 on a fresh communicator of the same backend (no rebuild);
    # the admission of the restarted process rebuilt the data plane on all four.
    assert not of(events, "data_plane", step=15), of(events, "data_plane", step=15)
    [admitted] = {a["step"] for a in of(events, "admit")}
    assert sorted(e["process"] for e in of(events, "data_plane", step=admitted)) == [0, 1, 2, 3], why
    assert_bitwise(load(out / "final-p1.npz"), reference)  # 4 processes, then 3, then 4: the 1-process bits
    # The worker hands the trainer host copies: every old CPU backend was freed after its rebuild.
    assert not of(events, "backend_leaked"), of(events, "backend_leaked")


@pytest.mark.smoke  # the float64 gloo all-reduce on the newest jax too
def test_the_float64_all_reduce_ends_with_the_1_process_bits_after_a_kill_and_a_rejoin(tmp_path):
    # reduction="allreduce64": fixed chunks summed in float64 by the step's one all-reduce
    # (the votes in its buffer). Not guaranteed bitwise (a sum within ~2^-53 of a float32
    # rounding boundary could round either way), but for this run it is: the survivors
    # trained at width 2 from step 15, process 1 rejoined, and the run ends with the bits of
    # a 1-process run.
    wide = ("--reduction", "allreduce64", "--exact_chunks", "8")
    ref = tmp_path / "ref"
    proc, _ = train(ref, MLP, "--steps", str(STEPS), "--admission", "ready", *wide,
                    "--final_params", str(ref / "final"), n=1)
    assert proc.returncode == 0, proc.describe()
    events, why, out = killed_and_restarted(tmp_path / "run", "kill:process=1:step=15:phase=in-step", 3, 0.05,
                                            reduction=wide, launch_flags=("--early-connect",))
    by_step = commits_by_step(events)
    assert sorted(by_step) == list(range(STEPS))
    assert by_step[15][0]["members"] == [0, 2] and by_step[STEPS - 1][0]["members"] == [0, 1, 2], why
    assert of(events, "rehydrated"), why
    assert_bitwise(load(out / "final-p1.npz"), load(ref / "final" / "final-p0.npz"))
    # --early-connect, one node, every member marked the dead life dropped: the restart
    # connected without waiting out the heartbeat (3 s + 1.5 s), but not before RESTART_GAP_S.
    [death] = of(events, "fault", process=1, incarnation=0)  # (logged as it kills itself)
    [connected] = of(events, "initialized", process=1, incarnation=1)
    assert RESTART_GAP_S <= connected["time"] - death["time"] < 3.0, (death, connected)
    assert connected["forget_wait_s"] < 3.0, connected


def test_a_kill_during_the_first_step_then_rejoin(reference, tmp_path):
    # Process 1 dies inside the very first step, while the others compile it. Its restart
    # found no running members yet, took itself for part of a cold start and queried over
    # every process: it trained alone (a second, diverging copy of the run), and the
    # members' liveness queries fell one query out of step with each other (one had re-asked
    # without the dead process, one was answered by the service), a 60 s reset-barrier
    # timeout and a second round of restarts (1 of 2 runs). Now the members publish who runs
    # at the step's entry, a would-be cold starter gives up its query when the others start
    # without it, and a smaller answer is always confirmed by one more query.
    events, why, out = killed_and_restarted(tmp_path, "kill:process=1:step=0:phase=in-step", 3, 0.15,
                                            "--hold_jax_params")
    by_step = commits_by_step(events)
    assert sorted(by_step) == list(range(STEPS))
    for step, commits in by_step.items():
        assert len({tuple(c["members"]) for c in commits}) == 1, f"step {step}: members disagree"
        assert sorted(c["process"] for c in commits) == list(commits[0]["members"]), step
    # The survivors trained at width 2 from the first step while process 1 restarted and set
    # up; every member admitted it at the same step, and it entered exactly there (rehydrated).
    admits = of(events, "admit")
    assert sorted(a["process"] for a in admits) == [0, 2] and len({a["step"] for a in admits}) == 1, admits
    entered = admits[0]["step"]
    assert all(by_step[s][0]["members"] == [0, 2] for s in range(entered)), why
    assert all(by_step[s][0]["members"] == [0, 1, 2] for s in range(entered, STEPS)), why
    [rehydrated] = of(events, "rehydrated")
    assert rehydrated["process"] == 1 and rehydrated["step"] == entered > 0
    assert_bitwise(load(out / "final-p1.npz"), reference)  # 2 devices, then 3: the 1-device bits
    # This worker keeps its initial params as jax arrays: the admission's rebuild could not
    # free the first backend, and every process that rebuilt says so.
    leaked = of(events, "backend_leaked")
    assert sorted(e["process"] for e in leaked) == [0, 1, 2], why


@pytest.mark.soak  # long: the default suite stays under its time budget
def test_a_late_joiner_of_a_finished_run_exits_0(tmp_path):
    # Process 2 dies at the last step; its restart finds the run finished and leaves quietly.
    proc, events = train(tmp_path, MLP, "--steps", "12", "--admission", "ready",
                         faults=["kill:process=2:step=11:phase=after-commit"], restart="on-failure")
    assert proc.returncode == 0, proc.describe()
    f = finals(events)
    assert {0, 1} <= {e["process"] for e in f} and all(e["step"] == 12 for e in f), proc.describe()
    assert len({e["params_sha256"] for e in f}) == 1


VOTES_PROGRAM = r'''
import re
import jax, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxft
from jaxft.bench.mlp import init_params, loss_fn, make_dataset
from jaxft.worker.data import shard_batch
from jaxft.core import votes as votes_lib
from jaxft.worker.programs import votes_array, with_votes
from jaxft.worker.train_step import make_train_step

G = 96
data = jaxft.GlobalBatches(make_dataset(1024), G, seed=0)
mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
rep = NamedSharding(mesh, P())
for reduction, chunks in (("allreduce", None), ("allreduce64", 8), ("exact", 8)):
    opt = optax.adam(1e-2)
    params = jax.device_put(init_params(0, 16, 32), rep)
    state = {"params": params, "opt_state": jax.device_put(opt.init(params), rep)}
    batch, mask = shard_batch(data.batch(0), mesh, chunk=G // chunks if chunks else None)
    votes = votes_array(votes_lib.row(np.array([0, 1, 0, 1], np.int32), 0), mesh, "data")
    if reduction != "exact":  # what ElasticTrainer runs: the votes in the step's own buffer
        inner = make_train_step(loss_fn, opt, G, mesh, jaxft.Reduction(reduction, chunks=chunks), votes=True)

        def fn(state, batch, mask, votes):
            p, o, loss, agreed = inner(state["params"], state["opt_state"], batch, mask, votes)
            return {"params": p, "opt_state": o}, {"loss": loss}, agreed

        fn = jax.jit(fn, out_shardings=rep)
    else:  # the votes summed beside the step (jaxft.worker.programs.with_votes)
        inner = make_train_step(loss_fn, opt, G, mesh, jaxft.Reduction(reduction, chunks=chunks))

        def step(state, batch, mask):
            p, o, loss = inner(state["params"], state["opt_state"], batch, mask)
            return {"params": p, "opt_state": o}, {"loss": loss}

        fn = with_votes(jax.jit(step, out_shardings=rep), mesh)
    text = fn.lower(state, batch, mask, votes).compile().as_text()
    # each collective op with the number of arrays it moves (a tuple op: one gloo collective each)
    ops = [f"{op}/{1 if not shape.startswith('(') else shape.count('[')}" for shape, op in re.findall(
        r"= (\([^)]*\)|\S+) (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(", text)]
    _, _, agreed = fn(state, batch, mask, votes)
    print(reduction, ",".join(ops), ",".join(map(str, np.asarray(agreed)[:4].tolist())))
'''


def test_the_votes_ride_in_the_steps_own_all_reduce():
    # One all-reduce of one buffer per step with the default reduction (the votes' max was a
    # second, independent op; then one tuple all-reduce of every leaf, the loss and the votes,
    # which gloo runs element by element), and the agreed votes are the same.
    from helpers import PYTHON, clean_env, run

    r = run([PYTHON, "-c", VOTES_PROGRAM], env=clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4"),
            timeout=240)
    assert r.returncode == 0, r.describe()
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines() if line.strip()}
    assert rows["allreduce"] == ["all-reduce/1", "0,1,0,1"], rows
    assert rows["allreduce64"] == ["all-reduce/1", "0,1,0,1"], rows  # one float64 buffer
    # the exact reduction: one all-gather of every leaf flattened (trainer._rows), the votes beside it
    assert sorted(rows["exact"][0].split(",")) == ["all-gather/1", "all-reduce/1"], rows
    assert rows["exact"][1] == "0,1,0,1", rows


def test_a_joiner_that_dies_in_its_admission_step_does_not_hold_the_members_in_gloo(reference, tmp_path):
    # Process 2 dies at step 6; its restart dies again in its admission step, after the rebuild's
    # barriers, before its first collective there (phase admitted, at the step it holds: 0).
    # The members' gloo rendezvous over the new list ran right after the barrier
    # (jaxft.worker.rendezvous), so their next collective fails on the broken connection instead of
    # waiting gloo's 30 s for a rendezvous key the dead process never wrote.
    out = tmp_path / "final"
    proc, events = train(tmp_path, MLP, "--steps", str(STEPS), "--admission", "ready", "--step_sleep", "0.1", *EXACT,
                         "--final_params", str(out), restart="on-failure",
                         faults=["kill:process=2:step=6", "kill:process=2:step=0:phase=admitted"])
    why = proc.describe()
    assert proc.returncode == 0, why
    kills = sorted(of(events, "fault", process=2), key=lambda e: e["time"])
    assert [k["phase"] for k in kills] == ["after-grad", "admitted"], kills
    failed = [e for e in of(events, "step_failed") if e["time"] > kills[1]["time"] and e["process"] != 2]
    assert failed and all(2 in e["failed"] for e in failed), failed
    assert not [e for e in failed if "timed out" in e["cause"]], failed  # gloo's GetKeyValue() timed out
    by_step = commits_by_step(events)
    assert sorted(by_step) == list(range(STEPS))
    # (the third incarnation rejoins, or exits 0 if the run finished as it came up)
    assert of(events, "exit", process=2, incarnation=2, code=0), why
    f = finals(events)
    assert {0, 1} <= {e["process"] for e in f} and len({e["params_sha256"] for e in f}) == 1, f
    assert_bitwise(load(out / "final-p0.npz"), reference)


# One process with a real coordination service: the newest member list [0, 2] was published by
# both members; 0's heartbeat has stopped (it died), 2's still moves (it is alive, stalled: no
# commit, so no newer list). Prints what a joiner (process 1) concludes.
STALLED = r"""
import json, threading, time
import jax
import jaxft
from jaxft.worker import admission, kv
from jaxft.timeouts import Timeouts

jax.distributed.initialize("127.0.0.1:%d" % int(__import__("sys").argv[1]), num_processes=1, process_id=0)
c = kv.client()
now = time.time()
for writer, beat, when in ((2, "2-alive", now - 5.0), (0, "0-dead", now)):  # the dead one's record is newest
    c.key_value_set(f"{admission.MEMBERS_KEY}/{writer}", json.dumps({"pids": [0, 2], "time": when, "beat": beat}))
    c.key_value_set(kv.Heartbeat.key(beat), "7")
stop = threading.Event()
def beat():
    n = 8
    while not stop.wait(0.2):
        c.key_value_set(kv.Heartbeat.key("2-alive"), str(n), allow_overwrite=True); n += 1
threading.Thread(target=beat, daemon=True).start()
joiner = admission.Joiner(1, Timeouts())
print("running", joiner.running_members(settle_s=1.0))
t0 = time.monotonic()
threading.Timer(1.5, stop.set).start()  # then 2 dies too
print("admitted", joiner.wait_admitted(members_gone_s=1.0), round(time.monotonic() - t0, 1))
jax.distributed.shutdown()
"""


def test_a_joiner_takes_the_run_for_gone_only_when_no_member_beats():
    # Only the newest record's publisher (the lowest member) was watched before: a joiner that
    # came up just after it died, the others stuck in a 60 s save barrier, took the run for
    # gone and started a second copy of it from the checkpoint beside them (a chaos run).
    r = run_python(STALLED, str(free_port()), timeout=60)
    assert r.returncode == 0, r.describe()
    assert "running [0, 2]" in r.stdout, r.describe()
    # once 2 stops too: gone (None) after members_gone_s, not before 2 stopped
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("admitted")]
    assert line.split()[1] == "None" and float(line.split()[2]) >= 2.0, r.describe()


# One process with a real coordination service. argv: port, "committed" or "fresh".
FINISHED_BEFORE_JOINING = r"""
import sys
import jax
import jaxft
from jaxft.worker import runs

jax.distributed.initialize("127.0.0.1:%d" % int(sys.argv[1]), num_processes=1, process_id=0)
group = jaxft.ElasticGroup()
group.begin_run(10)
if sys.argv[2] == "committed":
    with group.step():
        pass
group.exit_if_finished_before_joining()
print("still here: not finished", flush=True)
runs.end(1, 10)
group.exit_if_finished_before_joining()
print("still here: finished", flush=True)
"""


def test_a_life_that_committed_nothing_exits_0_after_a_failed_step_when_the_run_finished():
    # ElasticLoop calls this after each failed step: a cold start that waited out a barrier
    # while the members were finishing went on alone and trained a second copy (a chaos run).
    fresh = run_python(FINISHED_BEFORE_JOINING, str(free_port()), "fresh", timeout=60)
    assert fresh.returncode == 0, fresh.describe()
    assert "still here: not finished" in fresh.stdout and "still here: finished" not in fresh.stdout, fresh.describe()
    committed = run_python(FINISHED_BEFORE_JOINING, str(free_port()), "committed", timeout=60)
    assert committed.returncode == 0 and "still here: finished" in committed.stdout, committed.describe()


DEFAULT_ADMISSION = r'''
import numpy as np, optax
import jaxft
from jaxft.bench import mlp

rt = jaxft.initialize()
data = jaxft.GlobalBatches(mlp.make_dataset(64), 8, seed=0)
params = mlp.init_params(0, 4, 8)
print("group", jaxft.ElasticGroup().admission)
print("trainer", jaxft.ElasticTrainer(mlp.loss_fn, optax.sgd(0.1), params, data, runtime=rt).group.admission)
explicit = jaxft.LoopOptions(admission="connect")
print("explicit", jaxft.ElasticTrainer(mlp.loss_fn, optax.sgd(0.1), params, data, runtime=rt, options=explicit
                                       ).group.admission)
bare = jaxft.ElasticGroup()
with bare.step() as m:
    pass
print("bare", bare.admission, list(m.process_ids))
try:
    jaxft.ElasticGroup(admission="eager")
except ValueError as e:
    print("bad", e)
'''


def test_loops_default_to_ready_admission_and_a_bare_group_to_connect():
    # A bare `with group.step()` loop carries no votes: with ready admission a restarted
    # process would wait for an admission nobody can vote for.
    r = run_python(DEFAULT_ADMISSION, timeout=120)
    assert r.returncode == 0, r.describe()
    rows = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.strip())
    assert rows["group"] == "None" and rows["trainer"] == "ready" and rows["explicit"] == "connect", rows
    assert rows["bare"] == "connect [0]", rows
    assert rows["bad"] == "admission must be 'connect', 'ready' or None, got 'eager'", rows


STRANDED = str(Path(__file__).parent / "workers" / "stranded_cold_start.py")


def test_a_cold_start_process_named_in_an_answer_it_never_got_joins_the_others(tmp_path, one_process_exact):
    # The soak's hang (docs/design.md, 'A restart connects once the members dropped its
    # previous life'), made deterministic (tests/workers/stranded_cold_start.py): the first
    # lives of processes 1 and 3 die in the cold start's first query over all four; once 3's
    # restart has connected, 0 and 2 ask it, and the service, which keeps entrants by process
    # id, answers {0, 2, 3}: 3's new life, which never asked (1's restart had not connected).
    # 0 and 2 confirm {0, 2, 3}; 3's new life then asks over all four, and so does 1's restart.
    # Before: 0 and 2 waited for 3 in {0, 2, 3}, 3 and 1 for them in the query over all four,
    # for ever. Now 0 and 2 say what they confirm, 3 asks that too, the three start, and 1's
    # restart joins them as a restart does. When 3's first life had also asked over {0, 2, 3}
    # (on 1's death record, just before its own death), the confirmation completes at once and
    # 0 and 2 enter the first step with 3's new life: it takes their published entry instead.
    steps = 100
    proc, events = train(tmp_path, STRANDED, "--steps", str(steps), "--step_sleep", "0.06", *EXACT, n=4,
                         restart="on-failure", extra=["--heartbeat-timeout", "3"], timeout=180)
    why = proc.describe()
    assert proc.returncode == 0, why
    # (which of the two ways: whether 3's first life re-asked over the survivors on 1's death
    # record before its own death; both happen here, about half the runs each)
    switched = "process 3: the others confirm [0, 2, 3] on an answer it never got; asking that" in proc.stdout
    adopted = ("process 3: the members entered a step with it on an answer it never got; entering with them"
               in proc.stdout)
    assert switched or adopted, why
    by_step = commits_by_step(events)
    assert sorted(by_step) == list(range(steps)), why
    for step, commits in by_step.items():
        members = {tuple(c["members"]) for c in commits}
        assert len(members) == 1 and sorted(c["process"] for c in commits) == list(commits[0]["members"]), step
    assert by_step[0][0]["members"] == [0, 2, 3], why
    (admit, *_) = of(events, "admit")
    assert admit["joiners"] == [1], why
    assert by_step[steps - 1][0]["members"] == [0, 1, 2, 3], why
    fs = finals(events)
    assert sorted(f["process"] for f in fs) == [0, 1, 2, 3], why
    assert {f["params_sha256"] for f in fs} == {one_process_exact(steps)}, why


STALE_ENTRY = str(Path(__file__).parent / "workers" / "stale_member_entry.py")


def test_a_member_named_in_an_entry_answer_it_never_got_enters_with_the_others(tmp_path, one_process_exact):
    # Soak seed 2's hang at step 94, made deterministic (tests/workers/stale_member_entry.py):
    # process 2's first life leaves the exit query over (0, 1, 2) open, counted in, when 1 dies,
    # then dies itself. Once the restarts are admitted, the members' asks over all three complete
    # that query, naming 2's new life, whose own ask comes later and opens a new one. Before: the
    # members waited for 2 in the step, 2 for them in that new query, for ever. Now 2 finds the
    # members record of the step they entered with it, and enters with them.
    steps = 150  # (2's restart may take 5 s to set up: 60 steps ended first in a clean-clone CI)
    proc, events = train(tmp_path, STALE_ENTRY, "--steps", str(steps), "--step_sleep", "0.1", *EXACT, n=3,
                         faults=["kill:process=1:step=5:phase=after-grad", "kill:process=2:step=6"],
                         restart="on-failure", extra=["--heartbeat-timeout", "3"], timeout=180)
    why = proc.describe()
    assert proc.returncode == 0, why
    assert ("process 2: the others entered the step over [0, 1, 2] with it on an answer it never got"
            in proc.stdout), why
    by_step = commits_by_step(events)
    assert sorted(by_step) == list(range(steps)), why
    for step, commits in by_step.items():
        members = {tuple(c["members"]) for c in commits}
        assert len(members) == 1 and sorted(c["process"] for c in commits) == list(commits[0]["members"]), step
    assert by_step[steps - 1][0]["members"] == [0, 1, 2], why
    fs = finals(events)
    assert sorted(f["process"] for f in fs) == [0, 1, 2], why
    assert {f["params_sha256"] for f in fs} == {one_process_exact(steps)}, why


LAST_DIES_LATE = str(Path(__file__).parent / "workers" / "last_member_dies_late.py")


def test_a_cold_start_after_the_last_member_died_is_not_held_by_its_members_record(tmp_path, one_process_exact):
    # Soak seed 2's other hang, made deterministic (tests/workers/last_member_dies_late.py): 0 and
    # 3 die; 1 dies; 2, alone, enters its next step over 2 alone (a members record newer than the
    # restarts of 0 and 3) and dies once a restart waits to be admitted. Every process then
    # starts cold; 2's restart connects once 1's has confirmed an answer without 2. Before: each
    # cold query of 0 and 3 gave up at once on 2's record ('the others started without it'),
    # found nobody running and asked again, for ever, never asking the set 1 confirms. Now a
    # members record written before a process found its writers gone no longer counts.
    steps = 80
    proc, events = train(tmp_path, LAST_DIES_LATE, "--steps", str(steps), "--step_sleep", "0.1",
                         "--checkpoint_every", "5", *EXACT, n=4, restart="on-failure",
                         extra=["--heartbeat-timeout", "3"], timeout=180,
                         faults=["kill:process=0:step=6", "kill:process=3:step=6", "kill:process=1:step=8"])
    why = proc.describe()
    assert proc.returncode == 0, why
    alone = [c["step"] for c in of(events, "commit", process=2, incarnation=0) if c["members"] == [2]]
    assert alone, why
    (restored, *_) = of(events, "restored")  # (a cold start, from the newest checkpoint: steps again)
    assert restored["step"] <= alone[-1] + 1, why
    by_step = commits_by_step(events)
    assert sorted(by_step) == list(range(steps)), why
    cold = commits_by_step([e for e in events if e["time"] > restored["time"]])  # (the cold start on)
    assert sorted(cold) == list(range(restored["step"], steps)), why
    for step, commits in cold.items():
        members = {tuple(c["members"]) for c in commits}
        assert len(members) == 1 and sorted(c["process"] for c in commits) == list(commits[0]["members"]), step
    assert cold[restored["step"]][0]["members"] == [0, 1, 3], why  # (2's restart came later)
    assert cold[steps - 1][0]["members"] == [0, 1, 2, 3], why
    fs = finals(events)
    assert sorted(f["process"] for f in fs) == [0, 1, 2, 3], why
    assert {f["params_sha256"] for f in fs} == {one_process_exact(steps)}, why



# One process with a real coordination service: process 0 (life 5) runs alone and beats;
# process 2 (life 7) announced and waits to be admitted. Then a members record naming an earlier
# life of 2 (6), then one naming its life (7). Prints what the joiner's wait returns.
ENTERED_WHILE_WAITING = r"""
import json, sys, threading, time
import jax
from jaxft.worker import admission, coldstart, kv
from jaxft.timeouts import Timeouts

jax.distributed.initialize("127.0.0.1:%d" % int(sys.argv[1]), num_processes=1, process_id=0)
c = kv.client()


def record(writer, lives, beat):
    value = {"pids": sorted(lives), "lives": {str(p): i for p, i in lives.items()}, "time": time.time(), "beat": beat}
    c.key_value_set(f"{admission.MEMBERS_KEY}/{writer}", json.dumps(value), allow_overwrite=True)


record(0, {0: 5}, "0-alive")
stop = threading.Event()
def beat():
    n = 0
    while not stop.wait(0.1):
        for b in ("0-alive", "1-alive"):
            c.key_value_set(kv.Heartbeat.key(b), str(n), allow_overwrite=True)
        n += 1
threading.Thread(target=beat, daemon=True).start()
joiner = admission.Joiner(2, Timeouts())
joiner.announce()
threading.Timer(0.5, record, (1, {0: 5, 1: 3, 2: 6}, "1-alive")).start()  # an earlier life of 2
threading.Timer(2.0, record, (1, {0: 5, 1: 3, 2: 7}, "1-alive")).start()  # this life
t0 = time.monotonic()
out = joiner.wait_admitted(members_gone_s=3.0, entered=lambda entries: coldstart.adopted_entry(2, 7, entries))
print("entered", type(out).__name__, sorted(out.entry.items()) if hasattr(out, "entry") else out,
      round(time.monotonic() - t0, 1))
print("ready keys", list(kv.try_dir_get(admission.READY_PREFIX)))
stop.set()
jax.distributed.shutdown()
"""


def test_a_joiner_waiting_to_be_admitted_enters_with_members_that_entered_a_step_with_its_life():
    # Soak seed 2, session 35: a restart waited to be admitted while the members' restarts,
    # starting cold, entered a step with its life (a cold query it had left, counted in, that
    # their asks completed) and waited for it there; their beats moved, so it never took them
    # for gone, and all waited for ever. It now takes their entry (only one naming this life),
    # and withdraws its announcement.
    r = run_python(ENTERED_WHILE_WAITING, str(free_port()), timeout=60)
    assert r.returncode == 0, r.describe()
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("entered")]
    assert line.startswith("entered Adopt [(0, 5), (1, 3), (2, 7)]"), r.describe()
    assert float(line.split()[-1]) >= 2.0, r.describe()  # (not on the record naming an earlier life)
    assert "ready keys []" in r.stdout, r.describe()

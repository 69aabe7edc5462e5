"""Orbax async checkpoints on the live set, and a cold restart when every process dies.

Real processes (``jaxft launch`` of examples/mlp.py, 2 workers, 30 tiny steps):

* kill-all at step 13: every worker dies, each is restarted, all restore the newest
  complete checkpoint (10, or 5 if the async write of 10 had not been published), train
  to 30 and end where a fault-free run ends; only steps from the restored one on are
  committed twice.
* a worker killed while a save is in flight: the save is published by the survivor or
  abandoned, and every checkpoint that exists restores completely.
* process 0 dead for good: process 1 alone is the primary and writes complete
  checkpoints.
* a truncated checkpoint file: the next run (with another number of processes) rejects
  that checkpoint by name and restores the previous one.

And in a fresh interpreter: save/restore round trip of a pytree of many dtypes,
corruption detection, model mismatch.
"""

from __future__ import annotations

import collections
import glob
import hashlib
import json
import os
from pathlib import Path

import helpers
import numpy as np
import pytest
from helpers import EXACT, MLP

from jaxft import protocol

STEPS = 30
EVERY = 5
# The exact reduction makes every step's result independent of the width (a cold restart may
# run at another one): each run must end with the fault-free run's params, to the bit.


# -- helpers ---------------------------------------------------------------------------------

def launch(run_dir: Path, *args: str, n: int = 2, faults=(), restart: str = "on-failure",
           timeout: float = 240):
    """``jaxft launch -n N --run-dir R [--fault F]... -- python examples/mlp.py ARGS``."""
    return helpers.train(run_dir, MLP, *args, *EXACT, n=n, faults=faults, restart=restart, timeout=timeout)


def _tail(proc) -> str:
    return proc.describe()


def _final_shas(events) -> list[str]:
    return [e["params_sha256"] for e in helpers.by_event(events, "final")]


def _leaf_digests(arrays: dict) -> dict:
    """``{leaf name: sha256 of its dtype, shape and bytes}``: leaf-by-leaf equality."""
    return {k: hashlib.sha256(f"{v.dtype}{v.shape}".encode() + np.ascontiguousarray(v).tobytes()).hexdigest()
            for k, v in arrays.items()}


def _in_fresh_python(code: str, timeout: float = 120) -> dict:
    """Run ``code`` in a new interpreter (JAX state must not leak into the test process);
    it prints one JSON line last."""
    proc = helpers.run_python(code, timeout=timeout)
    assert proc.returncode == 0, _tail(proc)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _verify_dir(directory: str) -> dict:
    """Restore every finalized checkpoint of ``directory`` (full validation) in a fresh interpreter."""
    return _in_fresh_python(f"""
import json, os
from jaxft.worker.checkpoint import CheckpointStore, CheckpointRejected
store = CheckpointStore({directory!r}, process_id=0)
import hashlib
import numpy as np
out = {{"steps": store.steps(), "ok": [], "rejected": {{}}, "tmp": [], "params": {{}}}}
for step in out["steps"]:
    try:
        r = store.restore(step)
    except CheckpointRejected as e:
        out["rejected"][step] = e.reason
        continue
    out["ok"].append(step)
    params = {{k.split("_params_", 1)[1]: np.asarray(v) for k, v in r.tree.items() if "_params_" in k}}
    out["params"][step] = {{k: hashlib.sha256(f"{{v.dtype}}{{v.shape}}".encode() + np.ascontiguousarray(v).tobytes())
                             .hexdigest() for k, v in params.items()}}
out["tmp"] = sorted(n for n in os.listdir({directory!r}) if "orbax-checkpoint-tmp" in n)
print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """A fault-free run without checkpoints: its final ``params_sha256`` and per-leaf digests."""
    run_dir = tmp_path_factory.mktemp("reference")
    proc, events = launch(run_dir, "--steps", str(STEPS), "--final_params", str(run_dir / "final"), restart="never")
    assert proc.returncode == 0, _tail(proc)
    shas = _final_shas(events)
    assert len(shas) == 2 and shas[0] == shas[1], shas
    with np.load(run_dir / "final" / "final-p0.npz") as z:
        leaves = _leaf_digests({k: z[k] for k in z.files})
    return {"sha": shas[0], "leaves": leaves}


# -- (a) every process dies -------------------------------------------------------------------

def test_kill_all_restarts_cold_from_the_latest_complete_checkpoint(tmp_path, reference):
    run_dir = tmp_path / "run"
    # --step_sleep leaves the async write of checkpoint 5 time to finish before the kill
    # (10 may or may not be published by then: both outcomes are checked below).
    proc, ev = launch(run_dir, "--steps", str(STEPS), "--checkpoint_every", str(EVERY), "--step_sleep", "0.1",
                      faults=["kill-all:step=13"])
    assert proc.returncode == 0, _tail(proc)

    # Every worker died and was restarted once, on its own (launcher, --restart on-failure).
    assert sorted(e["process"] for e in helpers.by_event(ev, "restart")) == [0, 1], helpers.by_event(ev, "restart")
    assert sorted(e["process"] for e in helpers.by_event(ev, "fault") if e.get("action") == "kill-all") == [0, 1]
    kill_time = min(e["time"] for e in helpers.by_event(ev, "fault"))
    # No member ran on: the restarts connected at once (no wait for the service to forget
    # their previous lives, which holds up only members), and restored at once.
    waits = {e["process"]: e["forget_wait_s"] for e in helpers.by_event(ev, "initialized", incarnation=1)}
    assert waits == {0: 0.0, 1: 0.0}, waits
    assert not helpers.by_event(ev, "restore_deferred"), helpers.by_event(ev, "restore_deferred")

    # Each restarted process restored, from the default $JAXFT_RUN_DIR/checkpoints.
    restored = {e["process"]: e for e in helpers.by_event(ev, "restored", incarnation=1)}
    assert sorted(restored) == [0, 1], restored
    steps = {p: e["step"] for p, e in restored.items()}
    for e in restored.values():
        assert e["path"] == str(run_dir / "checkpoints" / str(e["step"]))
    assert not helpers.by_event(ev, "checkpoint_rejected")
    # A checkpoint published before the kill must be the one restored (newest complete).
    published = {e["step"] for e in helpers.by_event(ev, "checkpoint_saved", incarnation=0) if e["time"] < kill_time}
    assert max(published) in (5, 10), published
    r = min(steps.values())
    assert r in (5, 10) and r >= max(published), (steps, published)
    # Restored processes agree: all restarted from the same directory with no writer alive.
    # (A process that came up much later could find a newer checkpoint written by an early
    # peer in the new life; the trainer would rehydrate the older one, so only then differ.)
    for p, s in steps.items():
        if s != r:
            assert any(e["step"] == s for e in helpers.by_event(ev, "checkpoint_started", incarnation=1)), (steps, p)

    # Only steps from the restored one on are committed twice.
    commits = collections.Counter((e["process"], e["step"]) for e in helpers.by_event(ev, "commit"))
    for (p, s), count in commits.items():
        assert count <= 2, (p, s, count)
        if count == 2:
            assert r <= s < 13, (p, s)
    for p in (0, 1):
        # A process that came up late may have been rehydrated past some steps by its peer.
        late = bool(helpers.by_event(ev, "rehydrated", process=p, incarnation=1))
        for s in range(STEPS):
            expected = 2 if steps[p] <= s < 13 else 1
            if late:
                assert commits[(p, s)] <= expected, (p, s, commits[(p, s)], steps)
            else:
                assert commits[(p, s)] == expected, (p, s, commits[(p, s)], steps)
    first_after = min(e["step"] for e in helpers.by_event(ev, "commit", incarnation=1))
    assert first_after == r

    # It ends where a run without failures ends.
    shas = _final_shas(ev)
    assert shas == [reference["sha"]] * 2, (shas, reference["sha"])

    # What is left: the last --keep 3 checkpoints, all complete, no temporaries.
    check = _verify_dir(str(run_dir / "checkpoints"))
    assert check["steps"] == [20, 25, 30] and check["ok"] == [20, 25, 30], check
    assert check["tmp"] == [], check
    assert check["params"]["30"] == reference["leaves"], "checkpoint 30 holds the fault-free params, leaf by leaf"
    print(f"\nkill-all at 13: restored step {steps} (published before the kill: {sorted(published)}); "
          f"run took {proc.elapsed:.1f} s")


@pytest.mark.soak  # time budget (~31 s): the put-off restore is checked in the default suite by
# test_a_restart_whose_peers_finished_meanwhile_exits_without_training and test_correctness's
# joiner left without members; the rehydration's bits by every rejoin test
def test_a_restart_whose_peer_trains_on_puts_off_its_restore_and_is_rehydrated(tmp_path, reference):
    """Ready admission: a restarted process whose peer trains on would throw a checkpoint away
    for the member's newer state at its admission, so it does not read one."""
    proc, ev = launch(tmp_path / "run", "--steps", str(STEPS), "--checkpoint_every", str(EVERY),
                      "--checkpoint_dir", str(tmp_path / "ckpt"), "--step_sleep", "0.8",
                      faults=["kill:process=1:step=8"])
    assert proc.returncode == 0, _tail(proc)
    assert helpers.by_event(ev, "checkpoint_saved", process=0, step=5), "a checkpoint existed before the kill"
    [deferred] = helpers.by_event(ev, "restore_deferred", process=1, incarnation=1)
    assert deferred["step"] == 0, deferred
    [init] = helpers.by_event(ev, "initialized", process=1, incarnation=1)
    [kill] = helpers.by_event(ev, "fault", process=1, incarnation=0)
    # a member ran on: the restart waited before it connected (the heartbeat + 1.5 s, or with
    # --early-connect until the members dropped its previous life, never under RESTART_GAP_S)
    assert init["time"] - kill["time"] >= protocol.RESTART_GAP_S, (kill, init)
    assert not helpers.by_event(ev, "restored", process=1), "the restart read a checkpoint it would throw away"
    [rehydrated] = helpers.by_event(ev, "rehydrated", process=1)
    assert rehydrated["from_step"] == 0 and rehydrated["step"] > 8, rehydrated
    assert _final_shas(ev) == [reference["sha"]] * 2
    print(f"\nrestart of process 1: restore put off, rehydrated at step {rehydrated['step']}")


def test_a_restart_whose_peers_finished_meanwhile_exits_without_training(tmp_path):
    """Process 1 dies in the run's last step; its restart puts off its restore (process 0 trains
    on) and starts its run while process 0, which committed that step alone, is held after the
    commit by a hang; process 0 then finishes. The restart must not train alone: it exits 0
    having committed nothing. (The kill is in the last step so that no step is left to admit the
    restart to, however fast it comes back: with a kill three steps earlier, a restart that loaded
    its programs from a warm compilation cache was admitted once. Here it learns of the
    finish while it waits to be admitted. In the soak's seed 3, session 17, a restart looked
    for the finish just before it was marked and found the members gone a moment later: its
    cold start restored the run's last checkpoint and trained past the run's end, a final at
    step 101 of 100. A cold start now looks again (ElasticGroup._entry_query), and a step
    whose entry restored the run's last step is not run (ElasticLoop.try_step); that race has
    no fault point to make it happen here.)"""
    steps = 12
    proc, ev = launch(tmp_path / "run", "--steps", str(steps), "--checkpoint_every", str(EVERY),
                      "--checkpoint_dir", str(tmp_path / "ckpt"),
                      faults=[f"kill:process=1:step={steps - 1}",
                              f"hang:process=0:step={steps - 1}:phase=after-commit:for=8s"])
    assert proc.returncode == 0, _tail(proc)
    assert helpers.by_event(ev, "restore_deferred", process=1, incarnation=1), _tail(proc)
    assert helpers.too_late_to_rejoin(ev, 1), _tail(proc)
    assert not helpers.by_event(ev, "restored", process=1), _tail(proc)
    assert [e["step"] for e in helpers.by_event(ev, "final")] == [steps], _tail(proc)


def test_a_cold_start_that_restores_the_runs_last_step_trains_no_further(tmp_path):
    """What ``ElasticCheckpointer``'s put-off restore does at a cold start, with a hook of its
    own: the first step's entry restores the state of step 5 of a 5-step run. Nothing is left
    to train: the run ends there (before, the step ran and the final said step 6)."""
    code = """
import numpy as np, optax, jaxft
from jaxft.bench import mlp
rt = jaxft.initialize()
data = jaxft.GlobalBatches(mlp.make_dataset(256), 32, seed=0)
params = mlp.init_params(0, 16, 8)
trainer = jaxft.ElasticTrainer(mlp.loss_fn, optax.sgd(0.1), params, data, runtime=rt)
later = {"params": params, "opt_state": optax.sgd(0.1).init(params)}
trainer.loop.group.on_cold_start(lambda: trainer.loop.restore(5, later))
trainer.run(5)  # (logs the final event)
"""
    r = helpers.launch(1, [helpers.PYTHON, "-c", code], run_dir=tmp_path / "run", timeout=120)
    assert r.returncode == 0, r.describe()
    ev = helpers.events(tmp_path / "run")
    assert not helpers.by_event(ev, "commit"), r.describe()
    assert [e["step"] for e in helpers.by_event(ev, "final")] == [5], r.describe()


@pytest.mark.soak  # ~50 s: the default suite stays under its time budget
def test_a_put_off_restore_runs_when_every_member_died_meanwhile(tmp_path, reference):
    """The restart of process 1 puts off its restore (process 0 trains on) and stays in its
    set-up (a ``hang`` at ``restore-deferred``) while process 0 is killed too: its first step
    is then a cold start with process 0's restart, and it restores the checkpoint after all.
    (The hang lasts 25 s, to ~8 s after process 0's restart connected: with 15 s, it ended as
    that restart was connecting, twice in soak runs, and process 1 started alone, restored and
    admitted process 0 later, rehydrated: a valid run, but not this test's story.)"""
    proc, ev = launch(tmp_path / "run", "--steps", str(STEPS), "--checkpoint_every", str(EVERY),
                      "--checkpoint_dir", str(tmp_path / "ckpt"), "--step_sleep", "1.0",
                      faults=["kill:process=1:step=3", "hang:process=1:step=0:phase=restore-deferred:for=25s",
                              "kill:process=0:step=18"], timeout=300)
    assert proc.returncode == 0, _tail(proc)
    [deferred] = helpers.by_event(ev, "restore_deferred", process=1, incarnation=1)
    [p0] = helpers.by_event(ev, "restored", process=0, incarnation=1)
    [p1] = helpers.by_event(ev, "restored", process=1, incarnation=1)
    assert p1["time"] > deferred["time"] and p1["step"] == p0["step"] >= 10, (deferred, p0, p1)
    first = min(e["step"] for e in helpers.by_event(ev, "commit", process=1, incarnation=1))
    assert first == p1["step"], (first, p1)
    assert not helpers.by_event(ev, "rehydrated", process=1), "a cold start: nobody holds a newer step"
    assert _final_shas(ev) == [reference["sha"]] * 2


# -- (b) a process dies while a save is in flight ----------------------------------------------

@pytest.mark.soak  # long: the default suite stays under its time budget
@pytest.mark.parametrize("victim", [1, 0], ids=["non-primary", "primary"])
def test_kill_during_save_never_leaves_a_partial_checkpoint(tmp_path, reference, victim):
    run_dir = tmp_path / "run"
    ckpt_dir = tmp_path / "ckpt"
    # Checkpoint 10 (the state after 10 steps) is saved at the commit of step index 9;
    # the during-save fault point fires with 10 once the async save has started. Connect
    # admission: the restarted victim rejoins within the run (checked below; with ready
    # admission the survivor trains on while it sets up and can finish first).
    proc, ev = launch(run_dir, "--steps", str(STEPS), "--checkpoint_every", str(EVERY), "--keep", "0",
                      "--checkpoint_dir", str(ckpt_dir), "--admission", "connect",
                      faults=[f"kill:process={victim}:step=10:phase=during-save"])
    assert proc.returncode == 0, _tail(proc)
    survivor = 1 - victim

    fault = helpers.by_event(ev, "fault", process=victim, phase="during-save")
    assert len(fault) == 1 and fault[0]["step"] == 10, fault
    started = helpers.by_event(ev, "checkpoint_started", process=victim, incarnation=0, step=10)
    assert started and started[0]["time"] <= fault[0]["time"], "the save had started before the kill"

    # The survivor's save of 10 either finished (published without the dead member) or
    # was abandoned; never both, never neither.
    saved = helpers.by_event(ev, "checkpoint_saved", process=survivor, step=10)
    abandoned = helpers.by_event(ev, "checkpoint_abandoned", process=survivor, step=10)
    assert len(saved) + len(abandoned) == 1, (saved, abandoned)

    # The restarted victim restored the newest complete checkpoint (5, or 10 if it was
    # published; or a later one if the survivor went on alone and saved it meanwhile) and
    # was brought up to date by the trainer.
    restored = helpers.by_event(ev, "restored", process=victim, incarnation=1)
    assert len(restored) == 1, restored
    r = restored[0]["step"]
    published = {e["step"]: e["time"] for e in helpers.by_event(ev, "checkpoint_saved", process=survivor)}
    assert r == 5 or r in published, (r, published)
    assert r != 10 or saved, (r, abandoned)
    # (none a second before it: a standby's restart restored 0.8 s after 10 was published)
    settled = [s for s in [5, *published] if published.get(s, 0) < restored[0]["time"] - 1.0]
    assert r >= max(settled, default=5), (r, published)
    assert not helpers.by_event(ev, "checkpoint_rejected")
    first_commit = min(e["step"] for e in helpers.by_event(ev, "commit", process=victim, incarnation=1))
    assert first_commit == r or helpers.by_event(ev, "rehydrated", process=victim), (r, first_commit)

    shas = _final_shas(ev)
    assert shas == [reference["sha"]] * 2, (shas, reference["sha"])

    # Every checkpoint that exists restores completely; 10 exists iff it was published.
    check = _verify_dir(str(ckpt_dir))
    expected = [5, 10, 15, 20, 25, 30] if saved else [5, 15, 20, 25, 30]
    assert check["steps"] == expected and check["ok"] == expected, check
    assert check["rejected"] == {} and check["tmp"] == [], check
    assert check["params"]["30"] == reference["leaves"], "checkpoint 30 holds the fault-free params, leaf by leaf"
    print(f"\nkill process {victim} during save 10: {'published' if saved else 'abandoned'}; "
          f"victim restored {r}; run took {proc.elapsed:.1f} s")


def test_a_member_that_gave_up_on_a_dead_member_reports_what_the_primary_published(tmp_path):
    """Process 2 dies once every member's writes of checkpoint 10 are done (Orbax's write
    barrier passed), before the primary publishes. Process 1 gives up on it at Orbax's commit
    barrier, while the primary (process 0, held 3 s there) has all it needs to publish, and
    does. Process 1 must report what the primary did, not ``checkpoint_abandoned`` (it did, 30
    ms before the primary published, in a clean-clone CI run). (15 steps: a checkpoint 20
    published meanwhile would remove 10's unpublished directory, as superseded. 0.1 s steps: at
    full speed the last 5 steps ran in 60 ms, and process 2 wrote its final before its save
    reached the publish, in a clean-clone CI run.)"""
    ckpt = tmp_path / "ckpt"
    proc, ev = launch(tmp_path / "run", "--steps", "15", "--step_sleep", "0.1", "--checkpoint_every", "10",
                      "--checkpoint_dir", str(ckpt), n=3, restart="never",
                      faults=["kill:process=2:step=10:phase=before-publish",
                              "hang:process=0:step=10:phase=before-publish:for=3s"])
    assert proc.returncode == 1, _tail(proc)  # process 2 died and was not restarted
    (held,) = helpers.by_event(ev, "fault", process=0, phase="before-publish")
    (saved,) = helpers.by_event(ev, "checkpoint_saved", process=0, step=10)
    (died,) = helpers.by_event(ev, "exit", process=2)
    assert saved["time"] > held["time"] + 2.5 > died["time"], (held, saved, died)  # published late
    assert not helpers.by_event(ev, "checkpoint_abandoned"), _tail(proc)
    (seen,) = helpers.by_event(ev, "checkpoint_saved", process=1, step=10)
    assert seen["time"] > held["time"] + 2.5, (held, seen)  # (it sees the publish as the primary's watcher does)
    check = _verify_dir(str(ckpt))
    assert check["ok"] == [10] == check["steps"], check
    assert sorted(f["process"] for f in helpers.by_event(ev, "final")) == [0, 1], _tail(proc)


def test_a_save_superseded_while_its_primary_is_held_says_so(tmp_path):
    """As above, but the primary is held 8 s and the run goes on to checkpoint 20, which the
    two survivors publish first (a save of another member set: it does not wait for 10's).
    Its publication removes 10's unpublished files; 10 then fails on a missing file. Both
    members report it abandoned and say why: superseded by checkpoint 20 (the reason was a
    bare ``FileNotFoundError``)."""
    ckpt = tmp_path / "ckpt"
    proc, ev = launch(tmp_path / "run", "--steps", "20", "--checkpoint_every", "10", "--checkpoint_dir", str(ckpt),
                      n=3, restart="never", faults=["kill:process=2:step=10:phase=before-publish",
                                                    "hang:process=0:step=10:phase=before-publish:for=8s"])
    assert proc.returncode == 1, _tail(proc)
    for p in (0, 1):
        (abandoned,) = helpers.by_event(ev, "checkpoint_abandoned", process=p, step=10)
        assert "superseded by checkpoint 20" in abandoned["reason"], abandoned
        assert helpers.by_event(ev, "checkpoint_saved", process=p, step=20), _tail(proc)
    check = _verify_dir(str(ckpt))
    assert check["ok"] == [20] == check["steps"] and check["tmp"] == [], check


@pytest.mark.soak  # long: the default suite stays under its time budget
def test_live_subset_without_process_0_saves_complete_checkpoints(tmp_path, reference):
    """Process 0 dies for good: process 1 alone is the primary and writes everything
    (Orbax's numpy handler would write replicated arrays from process 0 only)."""
    run_dir = tmp_path / "run"
    proc, ev = launch(run_dir, "--steps", str(STEPS), "--checkpoint_every", str(EVERY), "--keep", "0",
                      faults=["kill:process=0:step=7"], restart="never")
    assert proc.returncode == 1, _tail(proc)  # process 0 failed and stayed dead
    saved = {e["step"]: e for e in helpers.by_event(ev, "checkpoint_saved", process=1)}
    # Checkpoint 5 (members 0 and 1, primary 0) was published, or abandoned if process 0
    # died before publishing it; from 10 on, process 1 saves alone.
    assert sorted(saved) in ([5, 10, 15, 20, 25, 30], [10, 15, 20, 25, 30]), sorted(saved)
    if 5 in saved:
        assert saved[5]["processes"] == [0, 1] and not saved[5]["primary"]
    else:
        assert helpers.by_event(ev, "checkpoint_abandoned", process=1, step=5)
    for step in (10, 15, 20, 25, 30):
        assert saved[step]["processes"] == [1] and saved[step]["primary"], saved[step]
    shas = _final_shas(ev)
    assert shas == [reference["sha"]], (shas, reference["sha"])
    check = _verify_dir(str(run_dir / "checkpoints"))
    assert check["ok"] == sorted(saved) and check["rejected"] == {} and check["tmp"] == [], check
    assert check["params"]["30"] == reference["leaves"], "checkpoint 30 holds the fault-free params, leaf by leaf"


# -- (c) a corrupt checkpoint --------------------------------------------------------------------

@pytest.mark.soak  # time budget: test_single_process_round_trip_of_many_dtypes rejects a damaged newest
# checkpoint and restores the previous one in the default suite (a byte flipped in every data file)
def test_truncated_checkpoint_is_rejected_and_the_previous_one_restored(tmp_path, reference):
    ckpt_dir = tmp_path / "ckpt"
    first, ev1 = launch(tmp_path / "run1", "--steps", "15", "--checkpoint_every", str(EVERY),
                        "--checkpoint_dir", str(ckpt_dir), n=1)
    assert first.returncode == 0, _tail(first)
    assert sorted(e["step"] for e in helpers.by_event(ev1, "checkpoint_saved")) == [5, 10, 15]

    # Truncate the largest data file of checkpoint 15 (Orbax/OCDBT data of the params).
    files = [f for f in glob.glob(str(ckpt_dir / "15" / "**" / "d" / "*"), recursive=True) if os.path.isfile(f)]
    victim = max(files, key=os.path.getsize)
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size // 2)

    # A new run, with another number of processes, over the same directory.
    run_dir = tmp_path / "run2"
    proc, ev = launch(run_dir, "--steps", str(STEPS), "--checkpoint_every", str(EVERY),
                      "--checkpoint_dir", str(ckpt_dir), n=2)
    assert proc.returncode == 0, _tail(proc)
    rejected = helpers.by_event(ev, "checkpoint_rejected")
    assert rejected, "the truncated checkpoint was not reported"
    for e in rejected:
        assert e["path"] == str(ckpt_dir / "15") and e["step"] == 15, e
        assert e["reason"], e
    restored = helpers.by_event(ev, "restored")
    assert sorted(e["process"] for e in restored) == [0, 1], restored
    assert all(e["step"] == 10 and e["path"] == str(ckpt_dir / "10") for e in restored), restored
    # Nothing trained on the broken state: training resumed at step 10 and ends as a
    # fault-free run does.
    assert min(e["step"] for e in helpers.by_event(ev, "commit")) == 10
    shas = _final_shas(ev)
    assert shas == [reference["sha"]] * 2, (shas, reference["sha"])
    # The rejected checkpoint was moved aside, so step 15 could be saved again.
    moved = [e["moved_to"] for e in rejected if e.get("moved_to")]
    assert len(moved) == 1 and os.path.isdir(moved[0]) and Path(moved[0]).parent == ckpt_dir / "rejected"
    assert 15 in [e["step"] for e in helpers.by_event(ev, "checkpoint_saved")]
    print(f"\ntruncated {os.path.relpath(victim, ckpt_dir)} ({size} -> {size // 2} bytes): rejected "
          f"{rejected[0]['reason'][:80]!r}; restored 10")


# -- (d) single process, in a fresh interpreter ---------------------------------------------------

UNIT = r"""
import collections, glob, json, os, sys
import numpy as np
import ml_dtypes
from jaxft.worker.checkpoint import CheckpointMismatch, CheckpointStore, state_checksum, flatten_state
from jaxft.errors import CheckpointError
from jaxft.worker.checkpoint.orbax import PrimaryNumpyHandler, set_barrier_timeout
from jaxft.events import EventLog, read_events

root = sys.argv[1]
Adam = collections.namedtuple("Adam", "count mu")
tree = {
    "f32": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    "bf16": np.arange(5).astype(ml_dtypes.bfloat16),
    "f16": np.array([1.5, -2.25], np.float16),
    "f64": np.array(np.pi),                       # 0-d
    "i8": np.array([-128, 127], np.int8),
    "i32": np.arange(6, dtype=np.int32).reshape(2, 3),
    "i64": np.array([2 ** 40, -3], np.int64),
    "u8": np.array([0, 255], np.uint8),
    "u32": np.array([7], np.uint32),
    "bool": np.array([True, False, True]),
    "c64": np.array([1 + 2j], np.complex64),
    "empty": np.zeros((0, 3), np.float32),       # Orbax refuses zero-size arrays: kept in metadata
    "opt": (Adam(np.array(3, np.int32), {"w": np.ones((2, 2), np.float32)}), ()),
}
import jax, jax.numpy as jnp
tree["jax_f32"] = jnp.arange(4, dtype=jnp.float32)
tree["jax_bf16"] = jnp.ones((2,), jnp.bfloat16)

events = EventLog(root, 0)
store = CheckpointStore(os.path.join(root, "ck"), keep=3, events=events, process_id=0)
out = {"empty_before": store.restore_latest(tree) is None}
for step in (1, 2, 3, 4):
    save = store.save(step, tree, metadata={"note": "unit"})
    assert save.wait(60) and save.ok, save.reason
out["steps"] = store.steps()

r = store.restore_latest(tree)
out["restored"] = r.step
assert jax.tree_util.tree_structure(r.tree) == jax.tree_util.tree_structure(tree)
for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(r.tree)):
    a = np.asarray(a)
    assert type(b) is np.ndarray and b.dtype == a.dtype and b.shape == a.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert np.array_equal(a, b), (a, b)
named, _, _ = flatten_state(tree)
out["checksum_ok"] = r.metadata["checksum"] == state_checksum(4, named)
out["user_meta"] = r.metadata["user"]["note"]
out["dtypes"] = sorted({str(np.asarray(x).dtype) for x in jax.tree_util.tree_leaves(r.tree)})

# A corrupt newest checkpoint: rejected by name, moved aside, the previous one restored.
# (every data file: one flip in the largest alone missed the leaves' bytes once in CI, and step 4 restored)
files = [f for f in glob.glob(os.path.join(root, "ck", "4", "**", "d", "*"), recursive=True) if os.path.isfile(f)]
assert files
for f in files:
    data = bytearray(open(f, "rb").read()); data[len(data) // 2] ^= 0x5A; open(f, "wb").write(data)
r = store.restore_latest(tree)
out["after_flip"] = r.step
rej = [e for e in read_events(root) if e["event"] == "checkpoint_rejected"]
out["rejected"] = [(e["step"], os.path.basename(e["path"]), e["reason"].split(":")[0]) for e in rej]
out["moved"] = sorted(os.listdir(os.path.join(root, "ck", "rejected")))
out["steps_after"] = store.steps()
# The step can be saved again once the broken copy is out of the way.
save = store.save(4, tree); assert save.wait(60) and save.ok, save.reason
out["resaved"] = store.restore_latest(tree).step

# Data that reads back but differs from what was saved: the stored SHA-256 catches it.
other_store = CheckpointStore(os.path.join(root, "ck2"), events=events, process_id=0)
assert other_store.save(1, tree).wait(60)
meta_file = os.path.join(root, "ck2", "1", "_CHECKPOINT_METADATA")
meta = json.load(open(meta_file))
meta["custom_metadata"]["checksum"] = "sha256:" + "0" * 64
json.dump(meta, open(meta_file, "w"))
try:  # its only checkpoint rejected: an error, never a silent start from step 0
    other_store.restore_latest(tree)
    out["tampered"] = False
except CheckpointError as e:
    out["tampered"] = "every checkpoint in" in str(e) and "refusing to start over" in str(e)
out["tampered_reason"] = [e["reason"] for e in read_events(root)
                          if e["event"] == "checkpoint_rejected" and "ck2" in e["path"]]

# An intact checkpoint of another model is an error, not a silent fresh start.
other = dict(tree); other["f32"] = np.zeros((4, 4), np.float32)
try:
    store.restore_latest(other)
    out["mismatch"] = None
except CheckpointMismatch as e:
    out["mismatch"] = "does not match the model" in str(e)
print(json.dumps(out))
"""


@pytest.mark.smoke
def test_single_process_round_trip_of_many_dtypes(tmp_path):
    out = _in_fresh_python(UNIT.replace("sys.argv[1]", repr(str(tmp_path))))
    assert out["empty_before"] is True
    assert out["steps"] == [2, 3, 4]  # keep=3
    assert out["restored"] == 4
    assert out["checksum_ok"] is True and out["user_meta"] == "unit"
    assert {"bfloat16", "float16", "float32", "float64", "int8", "int32", "int64", "uint8", "uint32", "bool",
            "complex64"} <= set(out["dtypes"])
    assert out["after_flip"] == 3
    assert [r[:2] for r in out["rejected"]] == [[4, "4"]] and out["rejected"][0][2], out["rejected"]
    assert len(out["moved"]) == 1 and out["moved"][0].startswith("4.")
    assert out["steps_after"] == [2, 3]
    assert out["resaved"] == 4
    assert out["mismatch"] is True
    assert out["tampered"] is True and out["tampered_reason"][0].startswith("checksum mismatch")


@pytest.mark.smoke
def test_orbax_private_names_still_exist():
    """jaxft.worker.checkpoint.orbax uses a few Orbax internals (pinned 0.12.x, listed in its
    docstring; jaxft.worker.checkpoint.managers builds on them); fail loudly if one moves or
    stops doing what the adapter relies on."""
    out = _in_fresh_python(r"""
import json, inspect, os, re, tempfile
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.multihost import multihost
from orbax.checkpoint._src.serialization import ocdbt_utils, tensorstore_utils, type_handlers
from orbax.checkpoint._src.checkpointers import async_checkpointer
from orbax.checkpoint._src.futures import future, synchronization
from jax._src.lib import _jax
from orbax.checkpoint._src.path import atomicity
from jaxft.worker.checkpoint import managers
from jaxft.worker.checkpoint import orbax as adapter
from jaxft.errors import SaveAbandoned
from jaxft.timeouts import Timeouts
import threading, types

def _barrier_seen_in_a_thread():
    save = types.SimpleNamespace(processes=(0, 1))
    got = []
    with adapter.blocking_barriers(save):
        t = threading.Thread(target=lambda: got.append(multihost.get_barrier_sync_fn(processes=[1, 0])))
        t.start(); t.join()
    return got == [save] and multihost.get_barrier_sync_fn(processes=[0, 1]) is not save

blocking_any_thread = _barrier_seen_in_a_thread()

root = tempfile.mkdtemp()
item = {"step": np.asarray(1, np.int64), "leaves": {"00000_w": np.arange(12, dtype=np.float32).reshape(3, 4),
                                                     "00001_b": np.array([1, -2], np.int8)}}

def files(d):  # relative paths, OCDBT data files by directory only (their names and number vary)
    return sorted({re.sub(r"/d/[0-9a-f]+$", "/d/*", os.path.relpath(os.path.join(r, f), d))
                   for r, _, fs in os.walk(d) for f in fs})

# 1. The numpy handler: Orbax's writes from process 0 only; the adapter's (primary host)
#    writes the same format, which Orbax's stock handlers read back.
h = type_handlers.NumpyHandler()
stock, ours = os.path.join(root, "stock"), os.path.join(root, "ours")
os.makedirs(stock); os.makedirs(ours)
m = ocp.CheckpointManager(stock, options=ocp.CheckpointManagerOptions(
    create=False, enable_async_checkpointing=False, save_root_metadata=False))
m.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(item)), force=True); m.wait_until_finished(); m.close()
m = managers.sync_manager(ours, 0, keep=None)
m.save(1, args=managers.save_args(item), force=True); m.wait_until_finished(); m.close()
m = ocp.CheckpointManager(ours, options=ocp.CheckpointManagerOptions(read_only=True, create=False))
np_args = ocp.RestoreArgs(restore_type=np.ndarray)
back = m.restore(1, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
    restore_args={"step": np_args, "leaves": {n: np_args for n in item["leaves"]}})))["state"]
m.close()
same_meta = (open(os.path.join(stock, "1", "state", "_METADATA")).read()
             == open(os.path.join(ours, "1", "state", "_METADATA")).read())

# 4. Orbax's barrier names: the save-in-progress flag is set at save start and reset at
#    finalize (so a second arrival without the commit means a failed background phase).
keys = []
def record(*, key, timeout_ms):
    keys.append(key)
ad = os.path.join(root, "async"); os.makedirs(ad)
m = managers.save_manager(ad, [0], "pfx", keep=None, barrier=record, async_timeout_s=60, before_commit=None)
m.save(1, args=managers.save_args(item), force=True); m.wait_until_finished(); m.close()
b = adapter.SaveBarrier("ns", [0, 1], 0, None, timeouts=Timeouts())
b._arriving("p_" + adapter.FINALIZE_KEY, 0)
try:
    b._arriving("p_" + adapter.FINALIZE_KEY, 1)
    failed_phase_reported = False
except SaveAbandoned:
    failed_phase_reported = True
b = adapter.SaveBarrier("ns", [0, 1], 0, None, timeouts=Timeouts())
b._passed("p_" + adapter.COMMIT_KEY + ".1", 0)
b._arriving("p_" + adapter.FINALIZE_KEY, 1)  # committed: the finalize reset is normal

# 2. and 3.
adapter.set_barrier_timeout(7)
adapter.private_signal_keys()
signal = list(synchronization.HandlerAwaitableSignal)[0]
signal_key = future.AwaitableSignalsContract.get_unique_awaitable_singal_key(signal, "1")
# 5. a manager's checkpointer, closed directly when close() re-raises a failed save
reader = managers.read_manager(ours, 0)
checkpointer_close = callable(getattr(getattr(reader, "_checkpointer", None), "close", None))
adapter.close_quietly(reader)
src = inspect.getsource(async_checkpointer._background_wait_for_commit_futures)
print(json.dumps({
  "timeout": multihost.coordination_timeout() == 7 == adapter.barrier_timeout()
             and "timeout or _DEFAULT_BARRIER_TIMEOUT" in inspect.getsource(multihost.sync_global_processes),
  "write_spec": callable(tensorstore_utils.build_array_write_spec),
  "subdir": (ocdbt_utils.get_process_index_for_subdir(use_ocdbt=True) == ocp.multihost.process_index() == 0
             and ocdbt_utils.get_process_index_for_subdir(use_ocdbt=False) is None),
  "finalized": (managers.is_finalized(os.path.join(ours, "1")) and managers.is_finalized(os.path.join(ad, "1"))
                and not managers.is_finalized(os.path.join(ours, "2" + managers.TMP_SUFFIX))
                and managers.TMP_SUFFIX == ".orbax-checkpoint-tmp"),
  "handler": all(hasattr(h, a) for a in ("_open_and_write", "_metadata_key", "_override_ocdbt_process_id",
                                          "_background_serialize")),
  "same_format": files(stock) == files(ours) and same_meta,
  "reads_back": all(np.array_equal(back["leaves"][n], a) and back["leaves"][n].dtype == a.dtype
                    for n, a in item["leaves"].items()) and int(back["step"]) == 1,
  "barrier_hook": all(k in src for k in ("async_write_complete", adapter.COMMIT_KEY, "on_commit_callback()")),
  "finalize_flag": ([k for k in keys if adapter.FINALIZE_KEY in k] == ["pfx_" + adapter.FINALIZE_KEY] * 2
                    and adapter.FINALIZE_KEY in inspect.getsource(synchronization)
                    and "_save_progress_tracker.set(False)" in inspect.getsource(ocp.CheckpointManager._finalize)),
  "failed_phase_reported": failed_phase_reported,
  "numpy_process0": "multihost.process_index() == 0" in inspect.getsource(type_handlers.NumpyHandler),
  "signal_prefix": (signal_key.startswith(adapter.signal_prefix() + "_1/")
                    and adapter.signal_prefix().startswith(f"awaitable_signals_contract_jaxft_{os.getpid()}_")),
  "preemption_hook": (callable(getattr(ocp.CheckpointManager, "reached_preemption", None))
                      and "self.reached_preemption(step)" in inspect.getsource(ocp.CheckpointManager.save)
                      and managers.LiveSetCheckpointManager.reached_preemption(None, 1) is False),
  "checkpointer_close": checkpointer_close,
  # 6. the blocking phase's barriers come from get_barrier_sync_fn, looked up at each call,
  #    also in the helper thread Orbax awaits the temporary directories' creation in
  "blocking_barrier": ("get_barrier_sync_fn(" in inspect.getsource(multihost.sync_global_processes)
                       and "multihost.sync_global_processes(" in inspect.getsource(ocp.CheckpointManager.save)
                       and "multihost.sync_global_processes(" in inspect.getsource(atomicity.create_all)),
  "blocking_barrier_any_thread": blocking_any_thread,
  "kv_client": all(hasattr(_jax.DistributedRuntimeClient, m) for m in
                   ("key_value_dir_get", "key_value_try_get", "key_value_delete", "key_value_set")),
}))
""")
    assert not [k for k, v in out.items() if not v], out


@pytest.mark.parametrize("records", [True, pytest.param(False, marks=pytest.mark.soak)],  # (time budget: 16 s)
                         ids=["launcher-records", "another-node"])
def test_a_death_before_a_save_abandons_it_without_waiting_out_the_barrier(tmp_path, records):
    # Process 2 dies as checkpoint 10 is due, before it begins it: the others are in the save's
    # blocking barriers (Orbax's save_start), which waited for it until Timeouts.save_barrier
    # (60 s). With the launcher's death records the save is cancelled at once. Without them and
    # without the dead life's retirement (a host that died whole; here the workers do not see
    # the state dir, so none marks its connection and the launcher retires nothing) the barrier
    # knows process 2 from the commit's member map only: its life (jaxft.worker.lives) names the
    # heartbeat to watch, which stops, and the save is abandoned after Timeouts.save_dead_after.
    # Either way training goes on and ends agreed.
    run_dir = tmp_path / "run"
    # (connect admission: the restart rejoins within the 20 steps; with ready admission the
    # others train on while it sets up and may finish first)
    train = ["--steps", "20", "--checkpoint_every", str(EVERY), "--checkpoint_dir", str(tmp_path / "ckpt"),
             "--admission", "connect"]
    kill = "kill:process=2:step=10:phase=before-save"
    if records:
        proc, ev = launch(run_dir, *train, n=3, faults=[kill])
    else:  # no restart: without the records a restart would not know the fault had fired
        hide = ["env", "-u", protocol.FAULT_STATE_DIR]
        proc = helpers.launch(3, [*hide, helpers.PYTHON, MLP, *train, *EXACT], "--restart", "never",
                              "--fault", kill, run_dir=run_dir, timeout=240)
        ev = helpers.events(run_dir)
    assert proc.returncode == (0 if records else 1), _tail(proc)  # 1: a worker died, not restarted
    (fault,) = helpers.by_event(ev, "fault", process=2, phase="before-save")
    why = "died before arriving" if records else "process 2 stopped heartbeating"
    for p in (0, 1):
        (abandoned,) = helpers.by_event(ev, "checkpoint_abandoned", process=p, step=10)
        assert abandoned["phase"] == "blocking", abandoned
        assert why in abandoned["reason"], abandoned  # given up on, not timed out
    finals = _final_shas(ev)
    assert len(set(finals)) == 1 and len(finals) == (3 if records else 2), finals

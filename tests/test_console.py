"""The progress console: what a person sees of a run, and where the rest of it goes."""

from helpers import MLP, PYTHON, launch

from jaxft.supervisor.tracker import LEFT, RunTracker


def _ev(t, event, **fields):
    return {"time": float(t), "event": event, "incarnation": fields.pop("incarnation", 0), **fields}


def _healthy_start(members: list[int], steps: int) -> list[dict]:
    """A run of 10 steps whose first ``steps`` steps commit at ``members``, one a second from t=2."""
    events = [_ev(0, "run_start", process="launcher"), _ev(1, "train_start", process=0, total_steps=10)]
    return events + [_ev(2 + s, "commit", process=p, step=s, members=members, loss=1.0)
                     for s in range(steps) for p in members]


def test_tracker_tells_one_story_per_incident():
    m3 = [0, 1, 2]
    events = _healthy_start(m3, 5)
    events += [_ev(7.0, "fault", process=2, step=5, action="kill"),
               _ev(7.1, "exit", process=2, signal="SIGKILL"), _ev(7.1, "restart", process=2, incarnation=1),
               _ev(8.0, "step_failed", process=0, step=5), _ev(8.0, "step_failed", process=1, step=5),
               _ev(8.5, "commit", process=0, step=5, members=[0, 1]),
               _ev(8.5, "commit", process=1, step=5, members=[0, 1]),
               _ev(9.0, "commit", process=0, step=6, members=[0, 1])]
    tracker = RunTracker(3)
    stories = [s for e in events for s in tracker.feed(e)]
    assert stories == []  # process 2 is not back yet
    assert tracker.step == 7 and tracker.width == 2 and tracker.incidents_seen == 1 and tracker.total == 10
    back = [_ev(10.0, "rehydrated", process=2, incarnation=1, step=7, from_step=0, donor=0, bytes=10, seconds=0.25),
            _ev(10.1, "commit", process=0, step=7, members=m3), _ev(10.1, "commit", process=2, step=7, members=m3)]
    stories = [s for e in back for s in tracker.feed(e)]
    assert stories == ["process 2 died at step 5 (SIGKILL); 2 members retried step 5 in 1.5 s; "
                       "process 2 rejoined at step 7, rehydrated from process 0 in 0.2 s"]
    assert "step 8/10" in tracker.line(11.0) and "incidents 1" in tracker.line(11.0)


def test_a_joiners_start_up_restore_and_a_run_that_ends_before_a_rejoin():
    m3 = [0, 1, 2]
    events = _healthy_start(m3, 3)
    events += [_ev(5.0, "fault", process=2, step=3, action="kill"),
               _ev(5.1, "exit", process=2, signal="SIGKILL"), _ev(5.1, "restart", process=2, incarnation=1),
               _ev(6.0, "step_failed", process=0, step=3), _ev(6.5, "commit", process=0, step=3, members=[0, 1]),
               # process 2's new life reads the latest checkpoint while it sets up, then a peer's state
               _ev(7.0, "restored", process=2, incarnation=1, step=2, seconds=0.1),
               _ev(8.0, "rehydrated", process=2, incarnation=1, step=5, from_step=2, donor=1, bytes=10,
                   seconds=0.3),
               _ev(8.1, "commit", process=0, step=5, members=m3), _ev(8.1, "commit", process=2, step=5, members=m3)]
    tracker = RunTracker(3)
    stories = [s for e in events for s in tracker.feed(e)]
    assert stories == ["process 2 died at step 3 (SIGKILL); 2 members retried step 3 in 1.5 s; "
                       "process 2 rejoined at step 5, rehydrated from process 1 in 0.3 s"]
    late = [_ev(9.0, "fault", process=1, step=6, action="kill"), _ev(9.1, "exit", process=1, signal="SIGKILL"),
            _ev(9.1, "restart", process=1, incarnation=1), _ev(9.5, "step_failed", process=0, step=6),
            _ev(9.8, "commit", process=0, step=6, members=[0, 2]),
            _ev(10.0, "restored", process=1, incarnation=1, step=7, seconds=0.1)]
    assert [s for e in late for s in tracker.feed(e)] == []
    assert tracker.finish() == ["process 1 died at step 6 (SIGKILL); 2 members retried step 6 in 0.8 s; "
                                "process 1 restarted; the run ended before it could rejoin"]


def test_progress_console_is_short_and_the_logs_hold_the_rest(tmp_path):
    # connect admission: the restart rejoins within the 16 steps (with ready admission the
    # survivor may finish first, and the incident line says so)
    r = launch(2, [PYTHON, MLP, "--steps", "16", "--checkpoint_every", "4", "--admission", "connect"],
               "--restart", "on-failure",
               "--fault", "kill:process=1:step=6", "--progress-every", "1000", run_dir=tmp_path,
               console="progress", timeout=180)
    assert r.returncode == 0, r.describe()
    lines = r.stdout.splitlines()
    incidents = [l for l in lines if l.startswith("[jaxft] incident: ")]
    assert len(incidents) == 1 and incidents[0].startswith("[jaxft] incident: process 1 died at step 6 (SIGKILL)"), \
        r.stdout
    assert "Traceback" not in r.stdout + r.stderr and not any(l.startswith("[0]") for l in lines), r.stdout
    assert "2 processes finished at step 16 with identical params" in r.stdout, r.stdout
    assert len(lines) <= 8, r.stdout
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["launcher.log", "process-0.incarnation-0.log", "process-1.incarnation-0.log",
                    "process-1.incarnation-1.log"], logs
    assert "done: step 16" in (tmp_path / "logs" / "process-0.incarnation-0.log").read_text()
    assert "restarting process 1" in (tmp_path / "logs" / "launcher.log").read_text()


def test_a_failing_worker_shows_its_last_lines(tmp_path):
    code = "import os, sys\nprint('about to fail', flush=True)\nsys.exit(int(os.environ['JAXFT_PROCESS_ID']) * 3)"
    r = launch(2, [PYTHON, "-c", code], run_dir=tmp_path, console="progress", timeout=60)
    assert r.returncode == 1, r.describe()
    assert "[jaxft] process 1 exited with code 3; its last lines" in r.stdout, r.stdout
    assert "    | about to fail" in r.stdout, r.stdout
    assert "process 0 exited" not in r.stdout


def test_each_life_shows_its_own_last_lines_and_a_crash_loop_is_told_once(tmp_path):
    # lives 0 and 1 fail alike, life 2 otherwise, 3-5 alike again: the guard stops it after 5
    code = ("import os, sys\nlife = int(os.environ['JAXFT_INCARNATION'])\n"
            "print('life', life if life == 2 else 'any', flush=True)\nsys.exit(4 if life == 2 else 3)")
    r = launch(1, [PYTHON, "-c", code], "--restart", "on-failure", run_dir=tmp_path, console="progress", timeout=60)
    assert r.returncode == 1, r.describe()
    shown = [l.split(";")[1].split("(")[0].strip() for l in r.stdout.splitlines() if " exited with code " in l]
    assert shown == ["its last lines", "the same last lines as incarnation 0", "its last lines",
                     "its last lines", "the same last lines as incarnation 3",
                     "the same last lines as incarnation 3"], r.stdout
    lines = r.stdout.splitlines()
    assert [l for l in lines if l.startswith("    | ")] == ["    | life any", "    | life 2", "    | life any"]
    loop = [i for i, l in enumerate(lines) if "crashed 3 times in a row before committing a step" in l]
    assert len(loop) == 1 and loop[0] > max(i for i, l in enumerate(lines) if "exited with code" in l), r.stdout
    assert ("[jaxft] incident: process 0 failed at step 0 (exit code 3); process 0 crashed 3 times in a row "
            "before a commit: not restarted") in lines, r.stdout


def test_a_relaunch_into_the_same_run_dir_tells_only_its_own_story(tmp_path):
    # A run dir is reused by a relaunch (the default one always is): its earlier events stay.
    code = "import os, sys\nprint('life', os.environ['JAXFT_INCARNATION'], flush=True)\nsys.exit(3)"
    for _ in range(2):
        r = launch(1, [PYTHON, "-c", code], run_dir=tmp_path, console="progress", timeout=60)
        assert r.returncode == 1, r.describe()
        told = [l for l in r.stdout.splitlines() if "exited with code 3" in l or l.startswith("[jaxft] incident")]
        assert len(told) == 2, r.stdout


def test_summary_counts_a_joiners_start_up_restore_as_no_checkpoint_restore():
    from jaxft.supervisor.report import summarize

    events = _healthy_start([0, 1], 2) + [
        # process 1's new life reads the checkpoint while it sets up, then takes process 0's state
        _ev(5.0, "restored", process=1, incarnation=1, step=1, seconds=0.1),
        _ev(6.0, "rehydrated", process=1, incarnation=1, step=2, from_step=1, donor=0, bytes=10, seconds=0.2),
        # process 0's second life restores cold (nobody is left to rehydrate it)
        _ev(7.0, "restored", process=0, incarnation=1, step=2, seconds=0.1),
        _ev(8.0, "run_end", process="launcher")]
    s = summarize(events)
    assert s["rejoins"] == 1 and s["restores"] == 1, s


def test_summary_counts_the_steps_a_failure_undid_before_their_commit():
    from jaxft.supervisor.report import format_summary, summarize

    events = _healthy_start([0, 1], 2) + [
        # commit_every: steps 2 and 3 ran on both, step 4 failed, both undid 2 and 3
        _ev(5.0, "rolled_back", process=0, step=2, steps=[2, 3], why="step 4 did not commit"),
        _ev(5.0, "rolled_back", process=1, step=2, steps=[2, 3], why="step 4 did not commit"),
        _ev(5.0, "step_failed", process=0, step=4, failed=[1]),
        _ev(8.0, "run_end", process="launcher")]
    s = summarize(events)
    assert (s["failed_step_attempts"], s["steps_undone"]) == (1, 4), s
    assert "steps retried       1 (and 4 run but undone, by process, before their commit)" in format_summary(s)
    assert "undone" not in format_summary(summarize(_healthy_start([0, 1], 2)))


def test_another_nodes_processes_lost_and_replaced_are_an_incident_here():
    """An agent sees no exit of another node's processes: their leaving the step, and jaxft
    slurm's node events, still make an incident on its console."""
    m4 = [0, 1, 2, 3]
    events = _healthy_start(m4, 4)
    events += [_ev(6.0, "step_failed", process=0, step=4),
               _ev(6.5, "commit", process=0, step=4, members=[0, 1]),  # 2 and 3 are gone: no exit seen here
               _ev(9.0, "node_lost", process="slurm", rank=1, node="n1", reason="no heartbeat for 5.0 s",
                   processes=[2, 3]),
               _ev(9.1, "node_started", process="slurm", rank=1, node="n2", generation=1, why="spare",
                   processes=[2, 3]),
               _ev(9.5, "commit", process=0, step=5, members=[0, 1])]
    tracker = RunTracker(4)
    assert [s for e in events[:-3] for s in tracker.feed(e)] == []
    assert tracker.open is not None and tracker.open.deaths == {2: LEFT, 3: LEFT}  # before jaxft slurm says more
    assert [s for e in events[-3:] for s in tracker.feed(e)] == []
    assert tracker.incidents_seen == 1 and tracker.width == 2
    back = [_ev(12.0, "rehydrated", process=2, step=8, donor=0, seconds=0.2),
            _ev(12.0, "rehydrated", process=3, step=8, donor=0, seconds=0.2),
            *(_ev(12.5, "commit", process=p, step=8, members=m4) for p in m4)]
    stories = [s for e in back for s in tracker.feed(e)]
    assert stories == ["processes 2, 3 died at step 4 (node n1 lost); "
                       "node n1 (rank 1) lost: no heartbeat for 5.0 s; rank 1: new agent on n2 (a spare); "
                       "process 2 rejoined at step 8, rehydrated from process 0 "
                       "in 0.2 s; process 3 rejoined at step 8, rehydrated from process 0 in 0.2 s"]

"""The supervisor behind ``jaxft launch``: one machine, or one node's agent of many.

Hosts the coordination service (single node, or the agent given ``--host-coordinator``)
or connects its workers to one elsewhere (``--coordinator HOST:PORT``), starts this
node's workers with their environment (global process ids ``node_rank * K + local``, one
GPU each on a GPU node), prefixes their output with the process id, records a dead
worker's death for the others at once and kills what it left in its process group, restarts
dead workers by policy, fires launcher-side faults (``kill:process=0:after=3s``) for its own
processes, and on Ctrl-C / SIGTERM ends every child, escalating to SIGKILL after a
bound. Children also get ``PR_SET_PDEATHSIG`` so that even a SIGKILLed launcher leaves
no orphans.

The parts: :mod:`~jaxft.supervisor.coordination` (the service), :mod:`~jaxft.supervisor.workers`
(the worker processes), :mod:`~jaxft.supervisor.restarts` (what follows a death); here, the
loop that watches the workers and carries the decisions out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import time
from typing import TextIO

from jaxft import faults, protocol
from jaxft.events import EventLog
from jaxft.protocol import EXIT_HUNG, Event
from jaxft.supervisor import crashloop
from jaxft.supervisor.console import Console, crash_loop_message
from jaxft.supervisor.coordination import ServiceLink
from jaxft.supervisor.launch_config import (
    LaunchConfig,
    Output,
    Service,
    Shutdown,
    Topology,
    check_run_dir,
    default_run_dir,
)
from jaxft.supervisor.procs import _exited, _is_stopped
from jaxft.supervisor.restarts import Action, Reason, RestartPolicy
from jaxft.supervisor.slurm import requeue
from jaxft.supervisor.workers import Worker, WorkerPool, exit_status

__all__ = ["Launcher", "LaunchConfig", "Output", "RestartPolicy", "Service", "Shutdown", "Topology"]

KILL_ALL_GRACE_S = 0.5  # the step's members die at the fault point themselves; then the rest
BEAT_EVERY_S = 1.0  # how often an agent under ``jaxft slurm`` rewrites its heartbeat file

logger = logging.getLogger(__name__)


class AgentBeat:
    """This agent's heartbeat for ``jaxft slurm`` (the file ``$JAXFT_NODE_BEAT``; a no-op without
    it): a counter rewritten every second while it supervises, then ``exit CODE`` as its last
    word, so the watcher tells an agent that ended from a node that died."""

    def __init__(self, path: str | None):
        self.path, self.count, self.due = path, 0, 0.0

    def tick(self, now: float) -> None:
        if self.path and now >= self.due:
            self.count += 1
            self.due = now + BEAT_EVERY_S
            self._write(str(self.count))

    def last(self, exit_code: int) -> None:
        if self.path:
            self._write(f"{protocol.BEAT_EXIT} {exit_code}")

    def _write(self, text: str) -> None:
        try:
            protocol.write_beat(self.path or "", text)
        except OSError as e:  # the watcher will take this node for dead; say why here
            logger.warning("cannot write the heartbeat file %s: %s", self.path, e)


class Launcher:
    """Runs one launch; :meth:`run` returns the exit code."""

    def __init__(self, config: LaunchConfig, out: TextIO = sys.stdout):
        self.rules = config.validate()
        self.timeouts = config.resolved_timeouts()
        self.run_dir_is_default = not config.output.run_dir
        if self.run_dir_is_default:  # the logs, events and checkpoints need a home
            run_dir = default_run_dir(config.command)
            check_run_dir(run_dir, "the default run dir", "; pass --run-dir, or set $JAXFT_RUNS_DIR")
            config = dataclasses.replace(config, output=dataclasses.replace(config.output, run_dir=run_dir))
        self.config = config
        o = config.output
        t = config.topology
        tag = f"[jaxft node {t.node_rank}]" if t.nnodes > 1 else "[jaxft]"
        self.console = Console(o.console, o.run_dir, out, t.total_processes, o.progress_every, tag)
        self.events = EventLog(o.run_dir, "launcher", 0)
        self.link = ServiceLink(config.topology, self.timeouts, self.console, self.events)
        self.pool = WorkerPool(config, self.timeouts, self.console, self.events, self.link)
        self.workers = self.pool.workers
        self._stop_signal: int | None = None
        self._setup_crashes: crashloop.SetupFailures | None = None  # set with the state dir (_run_workers)
        self.beat = AgentBeat(os.environ.get(protocol.NODE_BEAT))

    def say(self, text: str) -> None:
        self.console.say(text)  # the console (jaxft.supervisor.console) decides what a person sees

    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum

    # -- the run ------------------------------------------------------------------------
    def run(self) -> int:
        self.beat.tick(time.time())
        exit_code = 1
        try:
            exit_code = self._run()
        finally:
            self.beat.last(exit_code)
        return exit_code

    def _run(self) -> int:
        self.link.check_reachable()  # fail before starting anything
        t0 = time.time()
        # The service first (a busy or bad port fails here, before anything started), and
        # it goes last: workers are ended while it still runs, so they exit cleanly.
        self.console.start(" (default; pass --run-dir to choose)" if self.run_dir_is_default else "")
        try:
            with self.link.serve() as address:
                exit_code = self._run_workers(address, t0)
        except BaseException:
            self.console.restore_stderr()
            raise
        return exit_code

    def _run_workers(self, address: str, t0: float) -> int:
        c, t = self.config, self.config.topology
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.pool.open(address)
        assert self.pool.state_dir is not None, "open() makes the state dir"
        self._setup_crashes = crashloop.SetupFailures(self.pool.state_dir, c.restart.max_setup_crashes)
        exit_code = 1
        try:
            where = f"node {t.node_rank} of {t.nnodes}: " if t.nnodes > 1 else ""
            self.say(f"{where}coordinator at {address}; starting {t.num_processes} workers"
                     + (f" ({t.spares} of them hot spares: processes {list(t.spare_ids)})" if t.spares else ""))
            self.events.log(Event.RUN_START, num_processes=t.total_processes, coordinator=address,
                            command=list(c.command), faults=list(c.faults), restart=c.restart.mode,
                            source="launcher", node=t.node_rank, nnodes=t.nnodes,
                            **({"spares": list(t.spare_ids)} if t.spares else {}))
            for w in self.workers:
                self.pool.start(w)
            self.pool.start_standby()  # (niced: its imports come after the workers')
            exit_code = self._supervise(time.time())  # after= counts from here
        finally:
            self.pool.close()
            for s, h in old_handlers.items():
                signal.signal(s, h)
            self._write_summary(exit_code, time.time() - t0)
            self.console.close(exit_code, time.time() - t0, self.pool.restarts())
        return exit_code

    # -- the loop -----------------------------------------------------------------------
    def _supervise(self, t0: float) -> int:
        """Watch the workers until the job ends; its exit code."""
        timed = [r for r in self.rules if r.launcher_side]
        kill_alls = [r for r in self.rules if r.action == "kill-all"]
        hung_after = self.config.restart.hung_after_s
        if hung_after is None:
            hung_after = 2.0 * self.timeouts.heartbeat
        while True:
            if self._stop_signal is not None:
                name = signal.Signals(self._stop_signal).name
                self.say(f"received {name}; stopping all workers")
                self.events.log(Event.INTERRUPTED, signal=name, source="launcher")
                if os.environ.get(protocol.SLURM_REQUEUE) and not self.link.reachable():
                    self._requeue_if_asked()  # under jaxft slurm: the batch node died (and our srun with it)
                return 128 + self._stop_signal
            now = time.time()
            self.beat.tick(now)
            if not self.link.back(now):
                self._requeue_if_asked()
                return 1
            self._fire_timed(timed, now - t0)
            self._fire_kill_alls(kill_alls, now)
            for w in self.workers:
                if w.restart_at is not None:
                    if now >= w.restart_at and not self.link.lost:
                        w.restart_at = None
                        self.pool.start(w)
                    continue
                if w.done or w.proc is None:
                    continue
                code, reason = self._death(w, now, hung_after)
                if code is not None and not self._after_death(w, code, reason, now):
                    return 1
            if all(w.done and w.restart_at is None for w in self.workers):
                return 0 if all(w.returncode == 0 for w in self.workers) else 1
            time.sleep(0.05)

    def _requeue_if_asked(self) -> None:
        """Under ``jaxft slurm``: the service (on the batch node) is gone for good, so is the job's
        batch script; requeue the job, which resumes from its newest checkpoint."""
        job = os.environ.get(protocol.SLURM_REQUEUE)
        if not job:
            return
        why = requeue(job)
        self.console.warn(f"requeued SLURM job {job}: it resumes from its newest checkpoint" if why is None
                          else f"could not requeue SLURM job {job}: {why}")
        self.events.log(Event.JOB_REQUEUED, job=job, error=why, source="launcher")

    def _fire_timed(self, timed: list[faults.FaultRule], elapsed: float) -> None:
        """Fire the launcher-side faults (``after=``) that are due, for this node's processes."""
        for rule in list(timed):
            assert rule.after is not None, "a launcher-side rule fires after= seconds"
            if elapsed >= rule.after:
                timed.remove(rule)
                w = self.pool.local.get(rule.process) if rule.process is not None else None
                if w is None:  # another node's process: its own agent fires the rule
                    continue
                if w.running:
                    sig = signal.SIGSTOP if rule.action == "stop" else signal.SIGKILL
                    self.say(f"fault {rule.spec}: sending {sig.name} to process {rule.process}")
                    self.events.log(Event.FAULT, process=rule.process, incarnation=w.incarnation,
                                    action=rule.action, spec=rule.spec, source="launcher")
                    self.pool.signal(w, sig)

    def _fire_kill_alls(self, kill_alls: list[faults.FaultRule], now: float) -> None:
        """A ``kill-all`` that fired in the members takes the rest down a moment later."""
        for rule in list(kill_alls):
            fired = faults.fired_at(self.pool.state_dir, rule)
            if fired is not None and now - fired >= KILL_ALL_GRACE_S:
                kill_alls.remove(rule)
                self.pool.kill_the_rest(rule, fired)

    def _death(self, w: Worker, now: float, hung_after: float) -> tuple[int | None, str | None]:
        """``w``'s exit status and why, if its life is over (unreaped); ``(None, None)`` if it runs."""
        proc = w.life
        code = _exited(proc)
        if code is not None:
            return code, None
        # A SIGSTOPped worker is dead to its peers (no heartbeats) but never exits.
        if not _is_stopped(proc.pid):
            w.stopped_since = None
            return None, None
        w.stopped_since = w.stopped_since or now
        if now - w.stopped_since < hung_after:
            return None, None
        self.pool.signal(w, signal.SIGKILL)
        return _exited(proc, block=True), f"hung (stopped) for {hung_after:.0f} s"

    def _after_death(self, w: Worker, code: int, reason: str | None, now: float) -> bool:
        """Bury ``w``'s life and carry out the restart policy's decision; False: the job ends."""
        w.died_at = time.time()
        self.pool.end_life(w, code, reason)  # dead for sure: the local members are told first (jaxft.worker.deaths)
        if code == EXIT_HUNG:
            self.events.log(Event.HUNG, process=w.process_id, incarnation=w.incarnation, source="launcher")
        setup_crashes = self._setup_crashes
        assert setup_crashes is not None, "set in _run_workers, before any worker starts"
        crashes = setup_crashes.record(w.process_id, w.incarnation, code)
        decision = self.config.restart.decide(code, restarts=w.restarts,
                                              rounds=max(o.restarts for o in self.workers),
                                              crash_loop=setup_crashes.tripped(w.process_id))
        if decision.action is Action.RESTART:
            self._schedule_restart(w, now)
        elif decision.action is Action.RESTART_ALL:
            self._restart_everyone(w, now)
        else:
            w.done = True
            if decision.reason is Reason.CONFIG_ERROR:  # not a fault: restarting repeats it
                self.console.warn(f"process {w.process_id} stopped on a configuration error; not restarting it")
            elif decision.reason is Reason.CRASH_LOOP:  # a set-up that crashes alike life after life
                self._say_crash_loop(w, code, crashes)
        return decision.action is not Action.END_JOB

    def _say_crash_loop(self, w: Worker, code: int, crashes: int) -> None:
        """Log ``crash_loop``; the console shows it after the exit's last lines (progress), or now (raw)."""
        e = self.events.log(Event.CRASH_LOOP, process=w.process_id, incarnation=w.incarnation, crashes=crashes,
                            restart=self.config.restart.mode, source="launcher", **exit_status(code))
        self.say(crash_loop_message(e))

    def _schedule_restart(self, w: Worker, now: float) -> None:
        policy = self.config.restart
        self.link.note_if_lost(now)  # every worker dies with it: restart them once it is back
        w.restarts += 1
        w.done = False
        self.events.log(Event.RESTART, process=w.process_id, incarnation=w.incarnation + 1,
                        restarts=w.restarts, source="launcher")
        self.say(f"restarting process {w.process_id} (restart {w.restarts}/{policy.max_restarts})"
                 + (f" in {policy.delay_s:g} s" if policy.delay_s else ""))
        w.restart_at = now + policy.delay_s

    def _restart_everyone(self, failed: Worker, now: float) -> None:
        """``--restart all``: one failure takes every worker down; all start again, except
        those that already finished their work (exit 0)."""
        self.say(f"process {failed.process_id} failed: restarting all workers (--restart all)")
        self.pool.take_down_the_rest(failed)
        for w in self.workers:
            if w.restart_at is None and not (w.done and w.returncode == 0):
                self._schedule_restart(w, now)

    def _write_summary(self, exit_code: int, wall_s: float) -> None:
        t, run_dir = self.config.topology, self.config.output.run_dir
        summary = {
            "processes": t.num_processes,
            "restarts": {str(w.process_id): w.restarts for w in self.workers},
            "exit_code": exit_code,
            "wall_s": round(wall_s, 3),
            "final_returncodes": {str(w.process_id): w.returncode for w in self.workers},
            "exits": self.pool.exits,
        }
        self.events.log(Event.RUN_END, exit_code=exit_code, wall_s=round(wall_s, 3), source="launcher")
        if run_dir:
            name = "summary.json" if t.nnodes == 1 else f"summary-node{t.node_rank}.json"
            with open(os.path.join(run_dir, name), "w") as f:
                json.dump(summary, f, indent=2)
        self.say(f"done in {wall_s:.1f} s, exit code {exit_code}; restarts "
                 + ", ".join(f"p{w.process_id}={w.restarts}" for w in self.workers))

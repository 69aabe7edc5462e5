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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from jaxft import faults, priority, protocol
from jaxft.coordinator import Coordinator
from jaxft.errors import LaunchError
from jaxft.events import EventLog
from jaxft.net import wait_reachable
from jaxft.protocol import EXIT_BARRIER_TIMEOUT, EXIT_CONFIG_ERROR, EXIT_HUNG, Event
from jaxft.supervisor import crashloop, retire
from jaxft.supervisor.console import Console, crash_loop_message
from jaxft.supervisor.launch_config import RESTART_POLICIES, LaunchConfig, check_run_dir, default_run_dir
from jaxft.supervisor.procs import _fault_dir, _is_stopped, _set_pdeathsig, detect_gpus

__all__ = ["Launcher", "LaunchConfig", "LaunchError", "RESTART_POLICIES", "detect_gpus"]

# A life begun less than this before a worker's death cannot yet be a member: a restart of the
# same failure (it still imports); see Launcher._member_may_run
SAME_FAILURE_S = 1.0
KILL_ALL_GRACE_S = 0.5  # the step's members die at the fault point themselves; then the rest
# A dead life's reader gets this long to pass on its last lines: with the life's process group
# killed its pipe ends at once, unless a child left the group (setsid) and still holds it
READER_DRAIN_S = 0.5
RETIRE_BOUND_S = 1.0  # the longest a death record waits for the dead life's retirement in the service

EXIT_REASONS = {EXIT_CONFIG_ERROR: "configuration error", EXIT_HUNG: "hung: it stopped itself, stack in its output",
                EXIT_BARRIER_TIMEOUT: "gave up waiting at a barrier (Timeouts.barrier)"}


def _exit_status(code: int) -> dict:
    """An exit status as event fields: ``code`` (exited) or ``signal`` (its name; killed)."""
    return {"code": code} if code >= 0 else {"signal": signal.Signals(-code).name}


def _exited(proc: subprocess.Popen, block: bool = False) -> int | None:
    """``proc``'s exit status (Popen's convention: -N for signal N) once it has exited, else
    None; ``block``: wait for the exit. Where it can, it leaves ``proc`` unreaped (a zombie):
    its pid, and so the id of the process group it leads, cannot be reused before
    :meth:`Launcher._bury` has killed that group and reaped it."""
    if proc.returncode is not None or not hasattr(os, "waitid"):
        return proc.wait() if block else proc.poll()
    flags = os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG)
    try:
        info = os.waitid(os.P_PID, proc.pid, flags)
    except ChildProcessError:  # reaped already (Popen.poll elsewhere)
        return proc.wait() if block else proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


@dataclasses.dataclass
class _Worker:
    process_id: int
    proc: subprocess.Popen | None = None
    incarnation: int = -1
    restarts: int = 0
    done: bool = False
    returncode: int | None = None
    stopped_since: float | None = None
    restart_at: float | None = None  # a restart is pending until this time
    died_at: float | None = None  # wall-clock time its last incarnation exited
    launched_at: float = 0.0  # wall-clock time its current incarnation started
    reader: threading.Thread | None = None


class Launcher:
    """Runs one launch; :meth:`run` returns the exit code."""

    def __init__(self, config: LaunchConfig, out: TextIO = sys.stdout):
        self.config = config
        self.rules = config.validate()
        self.timeouts = config.resolved_timeouts()
        self.out = out
        self._print_lock = threading.Lock()
        self._stop_signal: int | None = None
        self.workers = [_Worker(config.first_process + i) for i in range(config.num_processes)]
        self._local = {w.process_id: w for w in self.workers}
        self.run_dir_is_default = not config.run_dir
        if self.run_dir_is_default:  # the logs, events and checkpoints need a home
            config.run_dir = default_run_dir(config.command)
            check_run_dir(config.run_dir, "the default run dir", "; pass --run-dir, or set $JAXFT_RUNS_DIR")
        self.console = Console(config.console, config.run_dir, out, config.total_processes, config.progress_every)
        self.events = EventLog(config.run_dir, "launcher", 0)
        self.exits: list[dict] = []
        self._lost_since: float | None = None  # when the external coordinator stopped answering
        self._setup_crashes: crashloop.SetupFailures | None = None  # set with the state dir (_run_workers)
        self._fault_dir: str | None = None  # the state dir shared with the workers (_run_workers)
        self._retirer: retire.Retirer | None = None  # retires dead lives in the service (_run_workers)

    # -- output -------------------------------------------------------------------------
    def say(self, text: str) -> None:
        self.console.say(text)  # the console (jaxft.supervisor.console) decides what a person sees

    # -- children -----------------------------------------------------------------------
    def _env(self, worker: _Worker, address: str, fault_dir: str) -> dict[str, str]:
        c = self.config
        env = dict(os.environ)
        env.update(c.extra_env)
        env.update({
            protocol.COORDINATOR: address,
            protocol.EXTERNAL_COORDINATOR: "1",
            protocol.PROCESS_ID: str(worker.process_id),
            protocol.NUM_PROCESSES: str(c.total_processes),
            protocol.INCARNATION: str(worker.incarnation),
            protocol.FAULTS: ";".join(c.faults),
            protocol.FAULT_STATE_DIR: fault_dir,
            "PYTHONUNBUFFERED": "1",
        })
        self.timeouts.export(env)
        if worker.died_at is not None:
            env[protocol.DIED_AT] = f"{worker.died_at:.3f}"
            env[protocol.PEERS_RUNNING] = "1" if c.nnodes > 1 or self._member_may_run(worker) else "0"
        else:
            env.pop(protocol.PEERS_RUNNING, None)
        if c.run_dir:
            env[protocol.RUN_DIR] = os.path.abspath(c.run_dir)
        if c.gpus is not None:
            env[protocol.LOCAL_DEVICE_IDS] = str(c.gpus[worker.process_id - c.first_process])
        else:
            env.pop(protocol.LOCAL_DEVICE_IDS, None)
        if c.gloo_interface:
            env[protocol.GLOO_INTERFACE] = c.gloo_interface
        if c.checkpoint_on_stop:
            env[protocol.CHECKPOINT_ON_STOP] = "1"
        return env

    def _member_may_run(self, worker: _Worker) -> bool:
        """Whether another local worker that may be a member runs on: one alive now whose life
        began more than ``SAME_FAILURE_S`` before ``worker`` died. If none does (every worker
        died, within moments of each other: a kill-all, a node's failure), the restart starts
        cold at once: it connects without waiting for the service to forget its previous
        life and does not wait on the stale member list (:class:`jaxft.ElasticGroup`); else
        it puts off its checkpoint restore (:meth:`jaxft.ElasticCheckpointer.restore`). A
        wrong guess either way costs time, not correctness."""
        died = worker.died_at or 0.0
        return any(o is not worker and o.proc is not None and o.proc.poll() is None
                   and o.launched_at < died - SAME_FAILURE_S for o in self.workers)

    def _start(self, worker: _Worker, address: str, fault_dir: str) -> None:
        worker.incarnation += 1
        env = self._env(worker, address, fault_dir)
        preexec = _set_pdeathsig
        nice = priority.lowered_nice(self.config.nice_restarts) if worker.incarnation > 0 else None
        if nice is not None:  # a restart sets up niced, and restores this priority as it joins
            env[protocol.BASE_NICE] = str(os.getpriority(os.PRIO_PROCESS, 0))

            def preexec() -> None:
                _set_pdeathsig()
                priority.start_niced(nice)
        worker.proc = subprocess.Popen(
            list(self.config.command), env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=preexec)
        worker.stopped_since, worker.launched_at = None, time.time()
        worker.reader = threading.Thread(target=self.console.pump,
                                         args=(worker.process_id, worker.incarnation, worker.proc.stdout),
                                         daemon=True)
        worker.reader.start()
        self.events.log(Event.LAUNCH, process=worker.process_id, incarnation=worker.incarnation,
                        pid=worker.proc.pid, source="launcher")

    def _signal_group(self, worker: _Worker, sig: int) -> None:
        if worker.proc is None:
            return
        try:
            os.killpg(worker.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _bury(self, worker: _Worker, code: int) -> None:
        """A life just seen dead with status ``code`` (unreaped where :func:`_exited` could):
        first record the death for the local members (they leave a step on it, see
        :mod:`jaxft.worker.deaths`; nothing before this may wait), then SIGKILL what it left in its
        process group (a child holding its stdout would keep its reader waiting, and outlive
        it and the launcher), reap it, and give its reader a moment for its last lines."""
        if code != 0 and self._fault_dir is not None:
            self._retire(worker)
            protocol.record_death(self._fault_dir, worker.process_id, worker.incarnation)
        self._signal_group(worker, signal.SIGKILL)
        worker.proc.wait()
        if worker.reader is not None:
            worker.reader.join(timeout=READER_DRAIN_S)

    def _retire(self, worker: _Worker) -> None:
        """Before the death is recorded: give the dead process a new incarnation in the
        coordination service (:mod:`jaxft.supervisor.retire`), so that no liveness query can answer with
        its dead life any more, whoever asks it late. Only a life that connected; bounded: a
        helper that does not answer within ``RETIRE_BOUND_S`` leaves the death to the heartbeat."""
        if self._retirer is None or self._lost_since is not None or self._fault_dir is None:
            return
        if not protocol.life_marked(self._fault_dir, protocol.CONNECTED, worker.process_id, worker.incarnation):
            return
        said = self._retirer.retire(worker.process_id, RETIRE_BOUND_S)
        if not said.startswith("done"):
            self.events.log(Event.RETIRE_FAILED, process=worker.process_id, incarnation=worker.incarnation,
                            why=said[:200], source="launcher")

    def _record_exit(self, worker: _Worker, code: int, reason: str | None = None) -> None:
        reason = reason or EXIT_REASONS.get(code)
        fields = _exit_status(code)
        if reason:
            fields["reason"] = reason
        self.exits.append({"process": worker.process_id, "incarnation": worker.incarnation, **fields})
        self.events.log(Event.EXIT, process=worker.process_id, incarnation=worker.incarnation,
                        source="launcher", **fields)
        desc = f"exit code {code}" if code >= 0 else f"killed by {fields['signal']}"
        self.say(f"process {worker.process_id} (incarnation {worker.incarnation}) {desc}"
                 + (f" ({reason})" if reason else ""))

    # -- main loop ----------------------------------------------------------------------
    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum

    def run(self) -> int:
        c = self.config
        if c.coordinator and not c.host_coordinator:  # fail before starting anything
            why = wait_reachable(c.coordinator, self.timeouts.initialization)
            if why is not None:
                raise LaunchError(f"node {c.node_rank}: cannot reach the coordinator at {c.coordinator} within "
                                  f"{self.timeouts.describe('initialization')} ({why}); start jaxft coordinator "
                                  "(or the agent with --host-coordinator) first, and check the address")
        t0 = time.time()
        # The service first (a busy or bad port fails here, before anything started), and
        # it goes last: workers are ended while it still runs, so they exit cleanly.
        self.console.start(" (default; pass --run-dir to choose)" if self.run_dir_is_default else "")
        try:
            with self._coordinator() as address:
                exit_code = self._run_workers(address, t0)
        except BaseException:
            self.console.restore_stderr()
            raise
        return exit_code

    def _run_workers(self, address: str, t0: float) -> int:
        c = self.config
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        fault_dir = self._fault_dir = _fault_dir()
        self._setup_crashes = crashloop.SetupFailures(fault_dir, c.max_setup_crashes)
        exit_code = 1
        try:
            where = f"node {c.node_rank} of {c.nnodes}: " if c.nnodes > 1 else ""
            self.say(f"{where}coordinator at {address}; starting {c.num_processes} workers")
            self.events.log(Event.RUN_START, num_processes=c.total_processes, coordinator=address,
                            command=list(c.command), faults=list(c.faults), restart=c.restart,
                            source="launcher", node=c.node_rank, nnodes=c.nnodes)
            if os.environ.get(protocol.RETIRE_LIVES) != "0":
                self._retirer = retire.Retirer(address)
                self._retirer.start()
            for w in self.workers:
                self._start(w, address, fault_dir)
            exit_code = self._supervise(address, fault_dir, time.time())  # after= counts from here
        finally:
            self._terminate_all()
            if self._retirer is not None:
                self._retirer.close()
            for s, h in old_handlers.items():
                signal.signal(s, h)
            shutil.rmtree(fault_dir, ignore_errors=True)
            self._write_summary(exit_code, time.time() - t0)
            self.console.close(exit_code, time.time() - t0, {w.process_id: w.restarts for w in self.workers})
        return exit_code

    @contextlib.contextmanager
    def _coordinator(self) -> Iterator[str]:
        """The address the workers dial: a service this launcher hosts, or one elsewhere."""
        c = self.config
        if c.coordinator and not c.host_coordinator:
            yield c.coordinator
            return
        port, bind = c.port, c.bind
        if c.coordinator:  # --host-coordinator: serve at --coordinator's port, on --bind (default: all)
            port = int(c.coordinator.rpartition(":")[2])
            bind = bind or "0.0.0.0"
        with Coordinator(c.total_processes, port=port, bind=bind or "127.0.0.1",
                         heartbeat_timeout=int(self.timeouts.heartbeat),
                         shutdown_timeout=int(self.timeouts.shutdown)) as coordinator:
            yield c.coordinator or coordinator.address

    def _supervise(self, address: str, fault_dir: str, t0: float) -> int:
        c = self.config
        timed = [r for r in self.rules if r.launcher_side]
        kill_alls = [r for r in self.rules if r.action == "kill-all"]
        hung_after = c.hung_after_s if c.hung_after_s is not None else 2.0 * self.timeouts.heartbeat
        while True:
            if self._stop_signal is not None:
                name = signal.Signals(self._stop_signal).name
                self.say(f"received {name}; stopping all workers")
                self.events.log(Event.INTERRUPTED, signal=name, source="launcher")
                return 128 + self._stop_signal
            now = time.time()
            if not self._coordinator_back(now):
                return 1
            for rule in list(timed):
                if now - t0 >= rule.after:
                    timed.remove(rule)
                    w = self._local.get(rule.process)
                    if w is None:  # another node's process: its own agent fires the rule
                        continue
                    if w.proc is not None and w.proc.poll() is None:
                        sig = signal.SIGSTOP if rule.action == "stop" else signal.SIGKILL
                        self.say(f"fault {rule.spec}: sending {sig.name} to process {rule.process}")
                        self.events.log(Event.FAULT, process=rule.process, incarnation=w.incarnation,
                                        action=rule.action, spec=rule.spec, source="launcher")
                        self._signal_group(w, sig)
            for rule in list(kill_alls):
                fired = faults.fired_at(fault_dir, rule)
                if fired is not None and now - fired >= KILL_ALL_GRACE_S:
                    kill_alls.remove(rule)
                    self._kill_the_rest(rule, fired)
            for w in self.workers:
                if w.restart_at is not None:
                    if now >= w.restart_at and self._lost_since is None:
                        w.restart_at = None
                        self._start(w, address, fault_dir)
                    continue
                if w.done or w.proc is None:
                    continue
                code = _exited(w.proc)
                reason = None
                if code is None:
                    # A SIGSTOPped worker is dead to its peers (no heartbeats) but never exits.
                    if _is_stopped(w.proc.pid):
                        w.stopped_since = w.stopped_since or now
                        if now - w.stopped_since < hung_after:
                            continue
                        self._signal_group(w, signal.SIGKILL)
                        code = _exited(w.proc, block=True)
                        reason = f"hung (stopped) for {hung_after:.0f} s"
                    else:
                        w.stopped_since = None
                        continue
                w.died_at = time.time()
                self._bury(w, code)  # dead for sure: the local members are told first (jaxft.worker.deaths)
                self._record_exit(w, code, reason)
                w.returncode = code
                if code == EXIT_HUNG:
                    self.events.log(Event.HUNG, process=w.process_id, incarnation=w.incarnation, source="launcher")
                crashes = self._setup_crashes.record(w.process_id, w.incarnation, code)
                if code == EXIT_CONFIG_ERROR:
                    w.done = True  # a configuration error is not a fault: restarting repeats it
                    self.console.warn(f"process {w.process_id} stopped on a configuration error; not restarting it")
                elif c.restart != "never" and self._setup_crashes.tripped(w.process_id):
                    w.done = True  # a set-up that crashes alike life after life: a restart repeats it
                    self._say_crash_loop(w, code, crashes)
                    if c.restart == "all":  # the job restarts as a whole or not at all
                        return 1
                elif code != 0 and c.restart == "all" and self._restarts_left():
                    self._restart_everyone(w, now)
                elif code != 0 and c.restart == "on-failure" and w.restarts < c.max_restarts:
                    self._schedule_restart(w, now)
                else:
                    w.done = True
            if all(w.done and w.restart_at is None for w in self.workers):
                return 0 if all(w.returncode == 0 for w in self.workers) else 1
            time.sleep(0.05)

    def _say_crash_loop(self, w: _Worker, code: int, crashes: int) -> None:
        """Log ``crash_loop``; the console shows it after the exit's last lines (progress), or now (raw)."""
        e = self.events.log(Event.CRASH_LOOP, process=w.process_id, incarnation=w.incarnation, crashes=crashes,
                            restart=self.config.restart, source="launcher", **_exit_status(code))
        self.say(crash_loop_message(e))

    def _kill_the_rest(self, rule: faults.FaultRule, fired: float) -> None:
        """A ``kill-all`` fired in the members at its step: SIGKILL every local worker that was
        alive then and still is (a restarted process setting up, outside the step), so the whole
        job dies, as the fault means, and none trains on from a step the others never reach."""
        for w in self.workers:
            if w.proc is None or w.proc.poll() is not None or w.launched_at >= fired:
                continue
            self.say(f"fault {rule.spec}: sending SIGKILL to process {w.process_id} (alive, outside the step)")
            self.events.log(Event.FAULT, process=w.process_id, incarnation=w.incarnation, action=rule.action,
                            spec=rule.spec, source="launcher")
            self._signal_group(w, signal.SIGKILL)

    def _coordinator_back(self, now: float) -> bool:
        """While the external coordinator is lost, hold restarts until it answers again, for
        at most ``Timeouts.initialization``; False when that bound ran out."""
        if self._lost_since is None:
            return True
        if wait_reachable(self.config.coordinator, 0.2) is None:
            self.console.warn(f"coordinator at {self.config.coordinator} is back after {now - self._lost_since:.1f} s; "
                     "restarting the workers (they restore the latest checkpoint)")
            self.events.log(Event.COORDINATOR_BACK, after_s=round(now - self._lost_since, 3), source="launcher")
            self._lost_since = None
            return True
        if now - self._lost_since > self.timeouts.initialization:
            self.console.warn(f"lost the coordinator at {self.config.coordinator}: no answer for "
                     f"{self.timeouts.describe('initialization')}; giving up")
            self.events.log(Event.COORDINATOR_GONE, waited_s=round(now - self._lost_since, 3), source="launcher")
            return False
        return True

    def _schedule_restart(self, w: _Worker, now: float) -> None:
        c = self.config
        if c.coordinator and not c.host_coordinator and self._lost_since is None \
                and wait_reachable(c.coordinator, 0.5) is not None:
            self._lost_since = now  # every worker dies with it: restart them once it is back
            self.console.warn(f"the coordinator at {c.coordinator} does not answer; holding restarts until it does "
                     f"(at most {self.timeouts.describe('initialization')})")
            self.events.log(Event.COORDINATOR_LOST, coordinator=c.coordinator, source="launcher")
        w.restarts += 1
        w.done = False
        self.events.log(Event.RESTART, process=w.process_id, incarnation=w.incarnation + 1,
                        restarts=w.restarts, source="launcher")
        self.say(f"restarting process {w.process_id} (restart {w.restarts}/{c.max_restarts})"
                 + (f" in {c.restart_delay_s:g} s" if c.restart_delay_s else ""))
        w.restart_at = now + c.restart_delay_s

    def _restarts_left(self) -> bool:
        """``--restart all`` restarts every worker at once: the budget is one per round."""
        return max(w.restarts for w in self.workers) < self.config.max_restarts

    def _restart_everyone(self, failed: _Worker, now: float) -> None:
        """``--restart all``: one failure takes every worker down; all start again, except
        those that already finished their work (exit 0)."""
        self.say(f"process {failed.process_id} failed: restarting all workers (--restart all)")
        for w in self.workers:
            if w is failed or w.proc is None or w.restart_at is not None or w.done:
                continue  # buried already
            reason = None  # died on its own in the same tick: still gets its exit event
            if _exited(w.proc) is None:
                self._signal_group(w, signal.SIGKILL)
                reason = "killed by --restart all"
            code = _exited(w.proc, block=True)
            self._bury(w, code)
            self._record_exit(w, code, reason)
            w.returncode = code
        for w in self.workers:
            if w.restart_at is None and not (w.done and w.returncode == 0):
                self._schedule_restart(w, now)

    def _terminate_all(self) -> None:
        live = [w for w in self.workers if w.proc is not None and w.proc.poll() is None]
        for w in live:
            self._signal_group(w, signal.SIGCONT)  # a stopped worker cannot act on SIGTERM
            self._signal_group(w, signal.SIGTERM)
        deadline = time.time() + self.config.grace_s
        for w in live:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.say(f"process {w.process_id} ignored SIGTERM for {self.config.grace_s:g} s; SIGKILL")
                self._signal_group(w, signal.SIGKILL)
                w.proc.wait()
            self._record_exit(w, w.proc.returncode, "terminated by launcher")
            w.returncode = w.proc.returncode
        for w in self.workers:  # also reap any grandchildren left in the groups
            self._signal_group(w, signal.SIGKILL)

    def _write_summary(self, exit_code: int, wall_s: float) -> None:
        summary = {
            "processes": self.config.num_processes,
            "restarts": {str(w.process_id): w.restarts for w in self.workers},
            "exit_code": exit_code,
            "wall_s": round(wall_s, 3),
            "final_returncodes": {str(w.process_id): w.returncode for w in self.workers},
            "exits": self.exits,
        }
        self.events.log(Event.RUN_END, exit_code=exit_code, wall_s=round(wall_s, 3), source="launcher")
        if self.config.run_dir:
            name = "summary.json" if self.config.nnodes == 1 else f"summary-node{self.config.node_rank}.json"
            with open(os.path.join(self.config.run_dir, name), "w") as f:
                json.dump(summary, f, indent=2)
        self.say(f"done in {wall_s:.1f} s, exit code {exit_code}; restarts "
                 + ", ".join(f"p{w.process_id}={w.restarts}" for w in self.workers))

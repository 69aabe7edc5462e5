"""The launcher's worker processes (:class:`WorkerPool`): start each life with its environment,
see it dead, bury it (record the death for the others, kill what it left, reap it), signal its
process group, and end them all at shutdown. What to do after a death is decided elsewhere
(:mod:`jaxft.supervisor.restarts`, :mod:`jaxft.supervisor.launcher`)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import threading
import time

from jaxft import faults, priority, protocol, standby
from jaxft.events import EventLog
from jaxft.protocol import EXIT_BARRIER_TIMEOUT, EXIT_CONFIG_ERROR, EXIT_HUNG, Event
from jaxft.supervisor import retire
from jaxft.supervisor.console import Console
from jaxft.supervisor.coordination import ServiceLink
from jaxft.supervisor.launch_config import LaunchConfig
from jaxft.supervisor.procs import _exited, _fault_dir, _set_pdeathsig
from jaxft.supervisor.standby import Standby
from jaxft.timeouts import Timeouts

# A life begun less than this before a worker's death cannot yet be a member: a restart of the
# same failure (it still imports); see WorkerPool.member_may_run
SAME_FAILURE_S = 1.0
# A dead life's reader gets this long to pass on its last lines: with the life's process group
# killed its pipe ends at once, unless a child left the group (setsid) and still holds it
READER_DRAIN_S = 0.5
RETIRE_BOUND_S = 1.0  # the longest a death record waits for the dead life's retirement in the service

EXIT_REASONS = {EXIT_CONFIG_ERROR: "configuration error", EXIT_HUNG: "hung: it stopped itself, stack in its output",
                EXIT_BARRIER_TIMEOUT: "gave up waiting at a barrier (Timeouts.barrier)"}


def exit_status(code: int) -> dict:
    """An exit status as event fields: ``code`` (exited) or ``signal`` (its name; killed)."""
    return {"code": code} if code >= 0 else {"signal": signal.Signals(-code).name}


def _later(default=None):
    """A field that the launcher sets as the worker lives, not a parameter of the constructor."""
    return dataclasses.field(init=False, default=default)


@dataclasses.dataclass
class Worker:
    """One local process id, across its lives (incarnations)."""

    process_id: int
    proc: subprocess.Popen | None = _later()
    incarnation: int = _later(-1)
    restarts: int = _later(0)
    done: bool = _later(False)
    returncode: int | None = _later()
    stopped_since: float | None = _later()
    restart_at: float | None = _later()  # a restart is pending until this time
    died_at: float | None = _later()  # wall-clock time its last incarnation exited
    retired: bool = _later(False)  # its last dead life was retired in the service (WorkerPool._retire)
    launched_at: float = _later(0.0)  # wall-clock time its current incarnation started
    reader: threading.Thread | None = _later()

    @property
    def life(self) -> subprocess.Popen:
        """The process of its current life (one has started: :meth:`WorkerPool.start`)."""
        assert self.proc is not None, f"process {self.process_id} has not started"
        return self.proc

    @property
    def running(self) -> bool:
        """Its current life has started and not exited (reaped or not)."""
        return self.proc is not None and self.proc.poll() is None


class WorkerPool:
    """This node's workers and the state dir they share with the launcher (:meth:`open` to
    :meth:`close`)."""

    def __init__(self, config: LaunchConfig, timeouts: Timeouts, console: Console, events: EventLog,
                 link: ServiceLink):
        self.config, self.timeouts, self.console, self.events, self.link = config, timeouts, console, events, link
        t = config.topology
        self.workers = [Worker(t.first_process + i) for i in range(t.num_processes)]
        self.local = {w.process_id: w for w in self.workers}
        self.exits: list[dict] = []  # every exit, for the summary
        self.state_dir: str | None = None  # shared with the workers (open)
        self.address: str | None = None  # of the service the workers dial (open)
        self._retirer: retire.Retirer | None = None  # retires dead lives in the service (open)
        self._standby: Standby | None = None  # the interpreter the next restart becomes (open)

    def open(self, address: str) -> None:
        """A fresh state dir, and the helper that retires dead lives at ``address``; no worker yet."""
        self.address = address
        self.state_dir = _fault_dir()
        if os.environ.get(protocol.RETIRE_LIVES) != "0":
            self._retirer = retire.Retirer(address)
            self._retirer.start()
        if self.config.restart.standby and self.config.restart.mode != "never":
            self._standby = Standby(self.config.command, self.common_env, self.console.say, self.state_dir)

    def start_standby(self) -> None:
        """Start this node's standby (none with ``--no-standby``, or for a command it cannot run)."""
        if self._standby is not None:
            self._standby.start()

    def close(self) -> None:
        """End every worker (:meth:`terminate_all`), the retiring helper, and the state dir."""
        self.terminate_all()
        if self._standby is not None:
            self._standby.close()
        if self._retirer is not None:
            self._retirer.close()
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def restarts(self) -> dict[int, int]:
        return {w.process_id: w.restarts for w in self.workers}

    # -- a life's start ------------------------------------------------------------------
    def common_env(self) -> dict[str, str]:
        """What every worker's environment holds, whichever life (a standby starts with it)."""
        c, t = self.config, self.config.topology
        assert self.address is not None and self.state_dir is not None, "open() the pool first"
        env = dict(os.environ)
        env.update(c.extra_env)
        env.update({
            protocol.COORDINATOR: self.address,
            protocol.EXTERNAL_COORDINATOR: "1",
            protocol.NUM_PROCESSES: str(t.total_processes),
            protocol.FAULTS: ";".join(c.faults),
            protocol.FAULT_STATE_DIR: self.state_dir,
            "PYTHONUNBUFFERED": "1",
        })
        for name in (protocol.PROCESS_ID, protocol.INCARNATION, protocol.DIED_AT, protocol.PEERS_RUNNING,
                     protocol.DROP_WITNESSES, protocol.LOCAL_DEVICE_IDS, protocol.BASE_NICE, standby.LIFE_STARTED):
            env.pop(name, None)  # (per life: below)
        if t.spares:
            env[protocol.SPARES] = ",".join(map(str, t.spare_ids))
        else:
            env.pop(protocol.SPARES, None)
        self.timeouts.export(env)
        if c.output.run_dir:
            env[protocol.RUN_DIR] = os.path.abspath(c.output.run_dir)
        if t.gloo_interface:
            env[protocol.GLOO_INTERFACE] = t.gloo_interface
        if c.shutdown.checkpoint_on_stop:
            env[protocol.CHECKPOINT_ON_STOP] = "1"
        return env

    def env(self, worker: Worker) -> dict[str, str]:
        """The environment of ``worker``'s current life."""
        t = self.config.topology
        env = self.common_env()
        env[protocol.PROCESS_ID] = str(worker.process_id)
        env[protocol.INCARNATION] = str(worker.incarnation)
        if worker.died_at is not None:
            env[protocol.DIED_AT] = f"{worker.died_at:.6f}"  # as precise as the marks compared with it
            env[protocol.PEERS_RUNNING] = "1" if t.nnodes > 1 or self.member_may_run(worker) else "0"
            env[protocol.DROP_WITNESSES] = ",".join(map(str, self.drop_witnesses(worker)))
        if t.gpus is not None:
            env[protocol.LOCAL_DEVICE_IDS] = str(t.gpus[worker.process_id - t.first_process])
        return env

    def member_may_run(self, worker: Worker) -> bool:
        """Whether another local worker that may be a member runs on: one alive now whose life
        began more than ``SAME_FAILURE_S`` before ``worker`` died. If none does (every worker
        died, within moments of each other: a kill-all, a node's failure), the restart starts
        cold at once: it connects without waiting for the service to forget its previous
        life and does not wait on the stale member list (:class:`jaxft.ElasticGroup`); else
        it puts off its checkpoint restore (:meth:`jaxft.ElasticCheckpointer.restore`). A
        wrong guess either way costs time, not correctness."""
        died = worker.died_at or 0.0
        return any(o is not worker and o.running and o.launched_at < died - SAME_FAILURE_S for o in self.workers)

    def drop_witnesses(self, worker: Worker) -> list[int]:
        """The processes whose marks let ``worker``'s restart connect early
        (:func:`jaxft.protocol.restart_may_connect`, ``jaxft launch --early-connect``): every
        other process of the run, if all are local and ran since before its death, and its dead
        life was retired; else none (the restart waits out the heartbeat timeout)."""
        died = worker.died_at or 0.0
        others = [o for o in self.workers if o is not worker]
        if not self.config.restart.early_connect or self.config.topology.nnodes > 1 or not worker.retired:
            return []
        if not all(o.running and o.launched_at < died for o in others):
            return []
        return [o.process_id for o in others]

    def start(self, worker: Worker) -> None:
        """Start ``worker``'s next life, its output pumped to the console."""
        worker.incarnation += 1
        env = self.env(worker)
        preexec = _set_pdeathsig
        nice = priority.lowered_nice(self.config.restart.nice_restarts) if worker.incarnation > 0 else None
        if nice is not None:  # a restart sets up niced, and restores this priority as it joins
            env[protocol.BASE_NICE] = str(os.getpriority(os.PRIO_PROCESS, 0))

            def preexec() -> None:
                _set_pdeathsig()
                priority.start_niced(nice)
        # A restart takes the standby only while a member runs on (it is admitted like any joiner):
        # the restarts of a failure that took every local worker start cold together, and one
        # of them far ahead of the others would start the run without them.
        candidate = self._standby if worker.incarnation > 0 and self.member_may_run(worker) else None
        proc = candidate.take(env, nice) if candidate is not None else None
        handed = proc is not None  # (a restart: the standby interpreter became it)
        if proc is None:
            proc = subprocess.Popen(
                list(self.config.command), env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=preexec)
        worker.proc = proc
        worker.stopped_since, worker.launched_at = None, time.time()
        worker.reader = threading.Thread(target=self.console.pump,
                                         args=(worker.process_id, worker.incarnation, worker.proc.stdout),
                                         daemon=True)
        worker.reader.start()
        self.events.log(Event.LAUNCH, process=worker.process_id, incarnation=worker.incarnation,
                        pid=worker.proc.pid, source="launcher", **({"standby": True} if handed else {}))
        if handed:
            self.start_standby()  # (the next restart's)

    # -- a life's end --------------------------------------------------------------------
    def signal(self, worker: Worker, sig: int) -> None:
        """Send ``sig`` to the process group of ``worker``'s current life."""
        if worker.proc is None:
            return
        try:
            os.killpg(worker.proc.pid, sig)
        except ProcessLookupError:
            pass

    def end_life(self, worker: Worker, code: int, reason: str | None = None) -> None:
        """A life seen dead with status ``code``: bury it, then log and say its exit."""
        self._bury(worker, code)
        self.record_exit(worker, code, reason)
        worker.returncode = code

    def _bury(self, worker: Worker, code: int) -> None:
        """A life just seen dead with status ``code`` (unreaped where :func:`_exited` could):
        first record the death for the local members (they leave a step on it, see
        :mod:`jaxft.worker.deaths`; nothing before this may wait), then SIGKILL what it left in its
        process group (a child holding its stdout would keep its reader waiting, and outlive
        it and the launcher), reap it, and give its reader a moment for its last lines."""
        if code != 0 and self.state_dir is not None:
            self._retire(worker)
            protocol.record_death(self.state_dir, worker.process_id, worker.incarnation)
        self.signal(worker, signal.SIGKILL)
        worker.life.wait()
        if worker.reader is not None:
            worker.reader.join(timeout=READER_DRAIN_S)

    def _retire(self, worker: Worker) -> None:
        """Before the death is recorded: give the dead process a new incarnation in the
        coordination service (:mod:`jaxft.supervisor.retire`), so that no liveness query can answer with
        its dead life any more, whoever asks it late. Only a life that connected; bounded: a
        helper that does not answer within ``RETIRE_BOUND_S`` leaves the death to the heartbeat."""
        worker.retired = False
        if self._retirer is None or self.link.lost or self.state_dir is None:
            return
        if not protocol.life_marked(self.state_dir, protocol.CONNECTED, worker.process_id, worker.incarnation):
            return
        said = self._retirer.retire(worker.process_id, worker.incarnation, RETIRE_BOUND_S)
        worker.retired = said.startswith("done")
        if not worker.retired:
            self.events.log(Event.RETIRE_FAILED, process=worker.process_id, incarnation=worker.incarnation,
                            why=said[:200], source="launcher")

    def record_exit(self, worker: Worker, code: int, reason: str | None = None) -> None:
        reason = reason or EXIT_REASONS.get(code)
        fields = exit_status(code)
        if reason:
            fields["reason"] = reason
        self.exits.append({"process": worker.process_id, "incarnation": worker.incarnation, **fields})
        self.events.log(Event.EXIT, process=worker.process_id, incarnation=worker.incarnation,
                        source="launcher", **fields)
        desc = f"exit code {code}" if code >= 0 else f"killed by {fields['signal']}"
        self.console.say(f"process {worker.process_id} (incarnation {worker.incarnation}) {desc}"
                         + (f" ({reason})" if reason else ""))

    def take_down_the_rest(self, failed: Worker) -> None:
        """``--restart all``: SIGKILL and bury every worker but ``failed`` that still runs or is
        unburied (not one finished, nor one whose restart is pending)."""
        for w in self.workers:
            if w is failed or w.proc is None or w.restart_at is not None or w.done:
                continue  # buried already
            reason = None  # died on its own in the same tick: still gets its exit event
            if _exited(w.proc) is None:
                self.signal(w, signal.SIGKILL)
                reason = "killed by --restart all"
            self.end_life(w, _exited(w.proc, block=True), reason)

    def kill_the_rest(self, rule: faults.FaultRule, fired: float) -> None:
        """A ``kill-all`` fired in the members at its step: SIGKILL every local worker that was
        alive then and still is (a restarted process setting up, outside the step), so the whole
        job dies, as the fault means, and none trains on from a step the others never reach."""
        for w in self.workers:
            if not w.running or w.launched_at >= fired:
                continue
            self.console.say(f"fault {rule.spec}: sending SIGKILL to process {w.process_id} (alive, outside the step)")
            self.events.log(Event.FAULT, process=w.process_id, incarnation=w.incarnation, action=rule.action,
                            spec=rule.spec, source="launcher")
            self.signal(w, signal.SIGKILL)

    def terminate_all(self) -> None:
        """SIGTERM every running worker, SIGKILL those still running ``Shutdown.grace_s`` later."""
        grace = self.config.shutdown.grace_s
        live = [w for w in self.workers if w.running]
        for w in live:
            self.signal(w, signal.SIGCONT)  # a stopped worker cannot act on SIGTERM
            self.signal(w, signal.SIGTERM)
        deadline = time.time() + grace
        for w in live:
            proc = w.life  # (running)
            try:
                proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.console.say(f"process {w.process_id} ignored SIGTERM for {grace:g} s; SIGKILL")
                self.signal(w, signal.SIGKILL)
                proc.wait()
            self.record_exit(w, proc.returncode, "terminated by launcher")
            w.returncode = proc.returncode
        for w in self.workers:  # also reap any grandchildren left in the groups
            self.signal(w, signal.SIGKILL)

"""The local supervisor behind ``jaxft launch``.

Hosts the coordination service, starts N workers with their environment, prefixes their
output with the process id, restarts dead workers by policy, fires launcher-side faults
(``kill:process=0:after=3s``), and on Ctrl-C / SIGTERM ends every child, escalating to
SIGKILL after a bound. Children also get ``PR_SET_PDEATHSIG`` so that even a SIGKILLed
launcher leaves no orphans.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence, TextIO

from jaxft import deaths, envvars
from jaxft.coordinator import Coordinator
from jaxft.errors import LaunchError, TimeoutsError
from jaxft.events import EventLog
from jaxft.faults import FaultRule, parse_rules
from jaxft.timeouts import Timeouts

# never: a dead worker stays dead; on-failure: restart just that worker (jaxft's elastic
# path); all: on any failure, kill every worker and restart all of them (what
# restart-from-checkpoint launchers do; the baseline of the chaos benchmark).
RESTART_POLICIES = ("never", "on-failure", "all")


@dataclasses.dataclass
class LaunchConfig:
    """Everything ``jaxft launch`` needs; validated by :meth:`validate`."""

    num_processes: int
    command: Sequence[str]
    restart: str = "never"
    max_restarts: int = 10
    faults: Sequence[str] = ()
    run_dir: str | None = None
    heartbeat_timeout: int | None = None  # shortcuts for --timeout heartbeat=S / collective=S
    collective_timeout: int | None = None
    port: int = 0
    bind: str = "127.0.0.1"
    gpus: Sequence[int] | None = None  # one local device id per process
    grace_s: float = 5.0  # SIGTERM -> SIGKILL bound at shutdown
    restart_delay_s: float = 0.0  # wait this long before restarting a dead worker
    hung_after_s: float | None = None  # a SIGSTOPped worker counts as dead after this
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    timeouts: Sequence[str] = ()  # NAME=SECONDS settings of jaxft.Timeouts (--timeout)

    def resolved_timeouts(self) -> Timeouts:
        """The workers' :class:`~jaxft.Timeouts`: ``--timeout`` settings, then the two shortcuts."""
        try:
            return Timeouts().updated(list(self.timeouts)).replace(
                heartbeat=self.heartbeat_timeout, collective=self.collective_timeout)
        except TimeoutsError as e:
            raise LaunchError(str(e)) from None

    def validate(self) -> list[FaultRule]:
        if self.num_processes < 1:
            raise LaunchError(f"-n must be >= 1, got {self.num_processes}")
        if not self.command:
            raise LaunchError("no worker command given; usage: jaxft launch -n N [options] -- COMMAND ARGS...")
        exe = self.command[0]
        if shutil.which(exe) is None:
            raise LaunchError(f"worker command {exe!r} not found (not on PATH, or not executable)")
        if self.restart not in RESTART_POLICIES:
            raise LaunchError(f"--restart must be one of {RESTART_POLICIES}, got {self.restart!r}")
        if self.restart_delay_s < 0:
            raise LaunchError("--restart-delay must be >= 0")
        if self.max_restarts < 0:
            raise LaunchError("--max-restarts must be >= 0")
        if any(t is not None and t < 1 for t in (self.heartbeat_timeout, self.collective_timeout)):
            raise LaunchError("--heartbeat-timeout and --collective-timeout must be >= 1 second")
        if self.gpus is not None and len(self.gpus) != self.num_processes:
            raise LaunchError(f"{len(self.gpus)} GPUs given for {self.num_processes} processes; "
                              "jaxft runs one process per GPU")
        self.resolved_timeouts()
        rules = parse_rules(list(self.faults))
        for rule in rules:
            if rule.process is not None and not 0 <= rule.process < self.num_processes:
                raise LaunchError(f"fault {rule.spec!r}: process {rule.process} does not exist "
                                  f"(processes are 0..{self.num_processes - 1})")
        return rules


def _set_pdeathsig() -> None:
    """In the child: die with SIGKILL when the launcher dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


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
        self.workers = [_Worker(i) for i in range(config.num_processes)]
        self.events = EventLog(config.run_dir, "launcher", 0)
        self.exits: list[dict] = []

    # -- output -------------------------------------------------------------------------
    def say(self, text: str) -> None:
        with self._print_lock:
            self.out.write(f"[jaxft] {text}\n")
            self.out.flush()

    def _pump(self, worker_id: int, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._print_lock:
                self.out.write(f"[{worker_id}] {line}\n")
                self.out.flush()
        stream.close()

    # -- children -----------------------------------------------------------------------
    def _env(self, worker: _Worker, coordinator: Coordinator, fault_dir: str) -> dict[str, str]:
        c = self.config
        env = dict(os.environ)
        env.update(c.extra_env)
        env.update({
            envvars.COORDINATOR: coordinator.address,
            envvars.EXTERNAL_COORDINATOR: "1",
            envvars.PROCESS_ID: str(worker.process_id),
            envvars.NUM_PROCESSES: str(c.num_processes),
            envvars.INCARNATION: str(worker.incarnation),
            envvars.FAULTS: ";".join(c.faults),
            envvars.FAULT_STATE_DIR: fault_dir,
            "PYTHONUNBUFFERED": "1",
        })
        self.timeouts.export(env)
        if worker.died_at is not None:
            env[envvars.DIED_AT] = f"{worker.died_at:.3f}"
        if c.run_dir:
            env[envvars.RUN_DIR] = os.path.abspath(c.run_dir)
        if c.gpus is not None:
            env[envvars.LOCAL_DEVICE_IDS] = str(c.gpus[worker.process_id])
        else:
            env.pop(envvars.LOCAL_DEVICE_IDS, None)
        return env

    def _start(self, worker: _Worker, coordinator: Coordinator, fault_dir: str) -> None:
        worker.incarnation += 1
        worker.proc = subprocess.Popen(
            list(self.config.command), env=self._env(worker, coordinator, fault_dir),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_set_pdeathsig)
        worker.stopped_since = None
        worker.reader = threading.Thread(target=self._pump, args=(worker.process_id, worker.proc.stdout),
                                         daemon=True)
        worker.reader.start()
        self.events.log("launch", process=worker.process_id, incarnation=worker.incarnation,
                        pid=worker.proc.pid, source="launcher")

    def _signal_group(self, worker: _Worker, sig: int) -> None:
        if worker.proc is None:
            return
        try:
            os.killpg(worker.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _record_exit(self, worker: _Worker, code: int, reason: str | None = None) -> None:
        fields = {"code": code} if code >= 0 else {"signal": signal.Signals(-code).name}
        if reason:
            fields["reason"] = reason
        self.exits.append({"process": worker.process_id, "incarnation": worker.incarnation, **fields})
        self.events.log("exit", process=worker.process_id, incarnation=worker.incarnation,
                        source="launcher", **fields)
        desc = f"exit code {code}" if code >= 0 else f"killed by {fields['signal']}"
        self.say(f"process {worker.process_id} (incarnation {worker.incarnation}) {desc}"
                 + (f" ({reason})" if reason else ""))

    # -- main loop ----------------------------------------------------------------------
    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum

    def run(self) -> int:
        c = self.config
        t0 = time.time()
        if c.run_dir:
            os.makedirs(c.run_dir, exist_ok=True)
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        fault_dir = tempfile.mkdtemp(prefix="jaxft-faults-")
        exit_code = 1
        try:
            with Coordinator(c.num_processes, port=c.port, bind=c.bind,
                             heartbeat_timeout=int(self.timeouts.heartbeat),
                             shutdown_timeout=int(self.timeouts.shutdown)) as coordinator:
                self.say(f"coordinator at {coordinator.address}; starting {c.num_processes} workers")
                self.events.log("run_start", num_processes=c.num_processes, coordinator=coordinator.address,
                                command=list(c.command), faults=list(c.faults), restart=c.restart,
                                source="launcher")
                for w in self.workers:
                    self._start(w, coordinator, fault_dir)
                exit_code = self._supervise(coordinator, fault_dir, time.time())  # after= counts from here
        finally:
            self._terminate_all()
            for s, h in old_handlers.items():
                signal.signal(s, h)
            shutil.rmtree(fault_dir, ignore_errors=True)
            self._write_summary(exit_code, time.time() - t0)
        return exit_code

    def _supervise(self, coordinator: Coordinator, fault_dir: str, t0: float) -> int:
        c = self.config
        timed = [r for r in self.rules if r.launcher_side]
        hung_after = c.hung_after_s if c.hung_after_s is not None else 2.0 * self.timeouts.heartbeat
        while True:
            if self._stop_signal is not None:
                name = signal.Signals(self._stop_signal).name
                self.say(f"received {name}; stopping all workers")
                self.events.log("interrupted", signal=name, source="launcher")
                return 128 + self._stop_signal
            now = time.time()
            for rule in list(timed):
                if now - t0 >= rule.after:
                    timed.remove(rule)
                    w = self.workers[rule.process]
                    if w.proc is not None and w.proc.poll() is None:
                        sig = signal.SIGSTOP if rule.action == "stop" else signal.SIGKILL
                        self.say(f"fault {rule.spec}: sending {sig.name} to process {rule.process}")
                        self.events.log("fault", process=rule.process, incarnation=w.incarnation,
                                        action=rule.action, spec=rule.spec, source="launcher")
                        self._signal_group(w, sig)
            for w in self.workers:
                if w.restart_at is not None:
                    if now >= w.restart_at:
                        w.restart_at = None
                        self._start(w, coordinator, fault_dir)
                    continue
                if w.done or w.proc is None:
                    continue
                code = w.proc.poll()
                reason = None
                if code is None:
                    # A SIGSTOPped worker is dead to its peers (no heartbeats) but never exits.
                    if _is_stopped(w.proc.pid):
                        w.stopped_since = w.stopped_since or now
                        if now - w.stopped_since < hung_after:
                            continue
                        self._signal_group(w, signal.SIGKILL)
                        code = w.proc.wait()
                        reason = f"hung (stopped) for {hung_after:.0f} s"
                    else:
                        w.stopped_since = None
                        continue
                if w.reader is not None:
                    w.reader.join(timeout=2)
                self._record_exit(w, code, reason)
                w.returncode, w.died_at = code, time.time()
                if code != 0:  # dead for sure: tell the local members now (jaxft.deaths)
                    deaths.record(fault_dir, w.process_id, w.incarnation)
                if code != 0 and c.restart == "all" and w.restarts < c.max_restarts:
                    self._restart_everyone(w, now)
                elif code != 0 and c.restart == "on-failure" and w.restarts < c.max_restarts:
                    self._schedule_restart(w, now)
                else:
                    w.done = True
            if all(w.done and w.restart_at is None for w in self.workers):
                return 0 if all(w.returncode == 0 for w in self.workers) else 1
            time.sleep(0.05)

    def _schedule_restart(self, w: _Worker, now: float) -> None:
        c = self.config
        w.restarts += 1
        w.done = False
        self.events.log("restart", process=w.process_id, incarnation=w.incarnation + 1,
                        restarts=w.restarts, source="launcher")
        self.say(f"restarting process {w.process_id} (restart {w.restarts}/{c.max_restarts})"
                 + (f" in {c.restart_delay_s:g} s" if c.restart_delay_s else ""))
        w.restart_at = now + c.restart_delay_s

    def _restart_everyone(self, failed: _Worker, now: float) -> None:
        """``--restart all``: one failure takes every worker down; all start again."""
        self.say(f"process {failed.process_id} failed: restarting all workers (--restart all)")
        for w in self.workers:
            if w is not failed and w.proc is not None and w.proc.poll() is None:
                self._signal_group(w, signal.SIGKILL)
                w.proc.wait()
                if w.reader is not None:
                    w.reader.join(timeout=2)
                self._record_exit(w, w.proc.returncode, "killed by --restart all")
        for w in self.workers:
            if w.restart_at is None:
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
        self.events.log("run_end", exit_code=exit_code, wall_s=round(wall_s, 3), source="launcher")
        if self.config.run_dir:
            with open(os.path.join(self.config.run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
        self.say(f"done in {wall_s:.1f} s, exit code {exit_code}; restarts "
                 + ", ".join(f"p{w.process_id}={w.restarts}" for w in self.workers))


def detect_gpus() -> list[int]:
    """Local NVIDIA GPU indices via ``nvidia-smi -L`` (empty when there are none)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [i for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]

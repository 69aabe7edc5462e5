"""``jaxft slurm``: the batch script's supervisor of a SLURM job (one agent per node, spares, replacements).

SLURM restarts no task of a step, ends a job whose node fails unless it runs with
``--no-kill``, and never returns from an ``srun`` whose node died. So the batch script runs
this supervisor, on the job's first node (the batch node), which

* hosts the coordination service there (the one node whose loss ends a SLURM job anyway;
  ``--requeue`` brings such a job back from its newest checkpoint);
* starts one agent step per training node (``srun -N1 --nodelist=NODE --overlap jaxft launch
  --nnodes K --node-rank R ...``), and keeps ``--spares`` (``$JAXFT_SPARE_NODES``) nodes in reserve;
* watches each agent's heartbeat file (``RUN_DIR/nodes/``, written by :class:`~jaxft.supervisor.launcher.AgentBeat`):
  a node whose agent fell silent is lost: its ``srun`` is killed and its step cancelled, and a
  new agent with the lost rank starts on a spare, or on a lost node once SLURM has it back
  (the decisions: :class:`~jaxft.supervisor.nodes.NodePlan`). The new agent's workers are
  admitted and rehydrated from the live ones, as on one machine, while the others train on;
* ends when every agent has ended, with 0 when training ended well: the job ends COMPLETED
  even if a node's task never reported back.

The batch node's loss is the one SLURM leaves to the job. With ``--no-kill`` it removes the
dead batch node from the job but neither ends nor requeues it (measured: the job stayed
RUNNING without its batch script), and an agent step often dies with its ``srun``, which runs
on the batch node (measured: a SIGKILLed ``srun`` cancels its step on the other node). An
agent that outlives it and loses the coordination service for good
(``Timeouts.initialization``) requeues the job (``scontrol requeue``; the job needs
``--requeue``), as does this supervisor if its service exits. Where no agent outlives it, the
job needs ``scontrol requeue JOB`` (a job trigger could do it, but only SlurmUser may set one).

Each agent's output goes to the job's output (its lines start with ``[jaxft node R]``); the
supervisor's own lines start with ``[jaxft slurm]`` and go to the run's ``events.jsonl`` too
(``node_lost``, ``node_started``), which every node's console and ``jaxft report`` read.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from jaxft import protocol
from jaxft.errors import LaunchError
from jaxft.events import EventLog
from jaxft.net import wait_reachable
from jaxft.protocol import Event
from jaxft.supervisor.nodes import Action, End, Lost, NodePlan, PlanOptions, Start, Stop

TICK_S = 0.25
DOWN_EVERY_S = 2.0  # how often to ask slurmctld which nodes are down, while a rank waits for one
CALL_TIMEOUT_S = 20.0  # one scontrol / squeue / scancel call
COORDINATOR_START_S = 60.0
SPARES = "JAXFT_SPARE_NODES"
AGENT_ARGS = "JAXFT_AGENT_ARGS"


@dataclasses.dataclass(frozen=True)
class SlurmConfig:
    """What ``jaxft slurm`` runs: ``command`` on ``nproc_per_node`` workers per training node."""

    command: tuple[str, ...]
    nproc_per_node: int
    run_dir: str
    spares: int = 0
    port: int = 29400
    agent_args: tuple[str, ...] = ()  # more ``jaxft launch`` options for every agent
    heartbeat_timeout: int = 10  # the coordination service's
    plan: PlanOptions = PlanOptions()


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The job's nodes, the batch node (where this runs) first."""

    job_id: str
    nodes: tuple[str, ...]
    restarts: int = 0  # SLURM_RESTART_COUNT: how often the job was requeued

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Allocation:
        job, nodelist = environ.get("SLURM_JOB_ID"), environ.get("SLURM_JOB_NODELIST")
        if not job or not nodelist:
            raise LaunchError("jaxft slurm runs inside a SLURM batch job (no SLURM_JOB_ID / SLURM_JOB_NODELIST)")
        nodes = _call(["scontrol", "show", "hostnames", nodelist]).split()
        here = environ.get("SLURMD_NODENAME") or nodes[0]
        if here in nodes:
            nodes = [here, *(n for n in nodes if n != here)]
        return cls(job, tuple(nodes), int(environ.get("SLURM_RESTART_COUNT") or 0))


def _call(args: Sequence[str], check: bool = True) -> str:
    """A SLURM client command's output (bounded)."""
    try:
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        if check:
            raise LaunchError(f"{' '.join(args)}: {e}") from None
        return ""
    if check and r.returncode != 0:
        raise LaunchError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def requeue(job_id: str) -> str | None:
    """Ask SLURM to requeue ``job_id`` (it must run with ``--requeue``); None, or why it failed.
    The requeued job asks for its original node count again, also after ``--no-kill`` had
    removed a failed node from it (measured)."""
    try:
        _call(["scontrol", "requeue", job_id])
    except LaunchError as e:
        return str(e)
    return None


def down_nodes(nodes: Sequence[str]) -> set[str]:
    """The nodes SLURM reports down, drained, failing or not responding."""
    out = _call(["sinfo", "-h", "-N", "-t", "down,drain,fail,no_respond", "-o", "%N", "-n", ",".join(nodes)],
                check=False)
    return set(out.split())


@dataclasses.dataclass
class _Step:
    """One agent's ``srun``."""

    start: Start
    proc: subprocess.Popen
    beat_path: str
    name: str


class SlurmSupervisor:
    """Runs one job's agents (:meth:`run` returns the batch script's exit code)."""

    def __init__(self, config: SlurmConfig, allocation: Allocation, out: TextIO = sys.stdout):
        if config.nproc_per_node < 1:
            raise LaunchError(f"-n must be >= 1 worker per node, got {config.nproc_per_node}")
        self.config, self.alloc, self.out = config, allocation, out
        try:
            self.plan = NodePlan(allocation.nodes, config.spares, config.plan)
        except ValueError as e:
            raise LaunchError(f"--spares / ${SPARES}: {e}") from None
        self.events = EventLog(config.run_dir, "slurm", allocation.restarts)
        self.steps: dict[int, _Step] = {}  # rank -> its agent's srun
        self._stop_signal: int | None = None
        self._coordinator: subprocess.Popen | None = None
        self._down: set[str] = set()  # the nodes SLURM reported down, asked at _down_at
        self._down_at = 0.0

    def say(self, text: str) -> None:
        self.out.write(f"[jaxft slurm] {text}\n")
        self.out.flush()

    # -- the run ------------------------------------------------------------------------------
    def run(self) -> int:
        c, a = self.config, self.alloc
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        code = 1
        try:
            self.say(f"job {a.job_id}{f' (requeued {a.restarts}x)' if a.restarts else ''}: "
                     f"{self.plan.ranks} training node(s) x {c.nproc_per_node} workers, "
                     f"{len(self.plan.spares)} spare(s); coordinator on {a.nodes[0]}:{c.port}; run dir {c.run_dir}")
            self.events.log(Event.RUN_START, source="slurm", job=a.job_id, nodes=list(a.nodes),
                            spares=list(self.plan.spares), requeued=a.restarts,
                            num_processes=self.plan.ranks * c.nproc_per_node)
            self._start_coordinator()
            code = self._watch()
        finally:
            self._end_steps()
            self._stop_coordinator()
            for s, h in old.items():
                signal.signal(s, h)
            self.events.log(Event.RUN_END, source="slurm", exit_code=code)
            self.say(f"done, exit code {code}")
        return code

    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum

    def _watch(self) -> int:
        self._carry(self.plan.start(time.time()))
        while True:
            if self._stop_signal is not None:
                self.say(f"received {signal.Signals(self._stop_signal).name}: stopping every agent")
                return 128 + self._stop_signal
            if self._coordinator is not None and self._coordinator.poll() is not None:
                why = requeue(self.alloc.job_id)
                self.say(f"the coordination service exited ({self._coordinator.returncode}): "
                         + ("job requeued" if why is None else f"ending the job (requeue failed: {why})"))
                self.events.log(Event.JOB_REQUEUED, source="slurm", job=self.alloc.job_id, error=why)
                return 1
            now = time.time()
            for rank, step in list(self.steps.items()):
                g = step.start.generation
                self._carry(self.plan.beat(rank, g, protocol.read_beat(step.beat_path), now))
                if step.proc.poll() is not None:
                    self._carry(self.plan.beat(rank, g, protocol.read_beat(step.beat_path), now))  # its last word
                    del self.steps[rank]
                    self._carry(self.plan.exited(rank, g, now))
            if self.plan.waiting and now - self._down_at >= DOWN_EVERY_S:  # ask slurmctld now and then
                self._down, self._down_at = down_nodes(self.alloc.nodes), now
            self._carry(self.plan.tick(now, self._down))
            if self.plan.ended is not None:
                return self.plan.ended.code
            time.sleep(TICK_S)

    # -- the plan's actions --------------------------------------------------------------------
    def _carry(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Start):
                self._start_agent(action)
            elif isinstance(action, Stop):
                self._stop_agent(action.rank)
            elif isinstance(action, Lost):
                procs = self._processes(action.rank)
                self.say(f"node {action.node} (rank {action.rank}, processes {procs[0]}-{procs[-1]}) lost: "
                         f"{action.reason}")
                self.events.log(Event.NODE_LOST, source="slurm", rank=action.rank, node=action.node,
                                reason=action.reason, processes=procs)
            elif isinstance(action, End):
                self.say(f"ending: {action.reason}")

    def _processes(self, rank: int) -> list[int]:
        n = self.config.nproc_per_node
        return list(range(rank * n, (rank + 1) * n))

    def _start_agent(self, s: Start) -> None:
        c = self.config
        name = f"jaxft-r{s.rank}g{s.generation}"
        beat = os.path.join(c.run_dir, "nodes", f"rank{s.rank}.g{s.generation}")
        if os.path.exists(beat):
            os.remove(beat)  # a previous attempt's (a requeued job)
        agent = [sys.executable, "-m", "jaxft.cli", "launch", "--nnodes", str(self.plan.ranks),
                 "--node-rank", str(s.rank), "-n", str(c.nproc_per_node),
                 "--coordinator", f"{self.alloc.nodes[0]}:{c.port}", "--run-dir", c.run_dir,
                 "--heartbeat-timeout", str(c.heartbeat_timeout), "--restart", "on-failure", *c.agent_args,
                 "--", *c.command]
        srun = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={s.node}", "--overlap", "--kill-on-bad-exit=0",
                f"--job-name={name}", *agent]
        env = {**os.environ, protocol.NODE_BEAT: beat, protocol.SLURM_REQUEUE: self.alloc.job_id}
        # srun writes the agent's output straight to the job's output: none of it passes
        # through this process. (A dead srun cancels its step whatever its output: see the
        # module's docstring on the batch node.)
        proc = subprocess.Popen(srun, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        self.steps[s.rank] = _Step(s, proc, beat, name)
        where = {"first": "", "spare": " (a spare node)", "returned": " (a node lost before, back)"}[s.why.value]
        procs = self._processes(s.rank)
        self.say(f"rank {s.rank} (processes {procs[0]}-{procs[-1]}): {'new ' if s.generation else ''}agent on "
                 f"{s.node}{where}")
        self.events.log(Event.NODE_STARTED, source="slurm", rank=s.rank, node=s.node, generation=s.generation,
                        why=s.why.value, processes=procs)

    def _stop_agent(self, rank: int) -> None:
        """Kill ``rank``'s srun here and cancel its step (its node may never answer)."""
        step = self.steps.pop(rank, None)
        if step is None:
            return
        if step.proc.poll() is None:
            os.killpg(step.proc.pid, signal.SIGKILL)
            step.proc.wait()
        self._cancel_step(step.name)

    def _cancel_step(self, name: str) -> None:
        out = _call(["squeue", "-h", "-s", "-j", self.alloc.job_id, "-o", "%i %j"], check=False)
        for line in out.splitlines():
            step_id, _, step_name = line.strip().partition(" ")
            if step_name == name:
                _call(["scancel", "--quiet", "--signal=KILL", step_id], check=False)

    def _end_steps(self) -> None:
        """At the end: every srun still running gets SIGTERM (its agent stops its workers), then SIGKILL."""
        for step in self.steps.values():
            if step.proc.poll() is None:
                step.proc.send_signal(signal.SIGTERM)  # srun forwards it to the agent
        deadline = time.monotonic() + 15
        for rank, step in list(self.steps.items()):
            try:
                step.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._stop_agent(rank)
        self.steps.clear()

    # -- the coordination service ---------------------------------------------------------------
    def _start_coordinator(self) -> None:
        c = self.config
        self._coordinator = subprocess.Popen(
            [sys.executable, "-m", "jaxft.cli", "coordinator", "--bind", "0.0.0.0", "--port", str(c.port),
             "--num-processes", str(self.plan.ranks * c.nproc_per_node),
             "--heartbeat-timeout", str(c.heartbeat_timeout)],
            stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + COORDINATOR_START_S
        while (why := wait_reachable(f"127.0.0.1:{c.port}", 1.0)) is not None:
            if self._coordinator.poll() is not None:
                raise LaunchError(f"the coordination service exited ({self._coordinator.returncode}) at start; "
                                  f"is port {c.port} free on {self.alloc.nodes[0]}? (--port)")
            if time.monotonic() > deadline:
                raise LaunchError(f"the coordination service did not listen on port {c.port} "
                                  f"within {COORDINATOR_START_S:g} s ({why})")

    def _stop_coordinator(self) -> None:
        p = self._coordinator
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def config_from_args(args, environ: Mapping[str, str] = os.environ) -> SlurmConfig:
    """The CLI's arguments (``jaxft slurm``) as a :class:`SlurmConfig`."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise LaunchError("no worker command: jaxft slurm [options] -- COMMAND ARGS...")
    spares = args.spares if args.spares is not None else int(environ.get(SPARES) or 0)
    agent_args = args.agent_args if args.agent_args is not None else environ.get(AGENT_ARGS, "")
    job = environ.get("SLURM_JOB_ID", "job")
    run_dir = os.path.abspath(args.run_dir or os.path.join(environ.get("SLURM_SUBMIT_DIR", "."), "runs", job))
    plan = PlanOptions(node_timeout_s=args.node_timeout, start_timeout_s=args.start_timeout,
                       retry_s=args.retry_after, max_replacements=args.max_replacements)
    return SlurmConfig(tuple(command), args.num_processes, run_dir, spares=spares, port=args.port,
                       agent_args=tuple(shlex.split(agent_args)), heartbeat_timeout=args.heartbeat_timeout,
                       plan=plan)


def add_parser(sub) -> None:
    """``jaxft slurm``'s options."""
    p = sub.add_parser("slurm", help="inside a SLURM batch script: one agent per node, spares, replacements",
                       usage="jaxft slurm -n WORKERS_PER_NODE [options] -- COMMAND ARGS...")
    p.add_argument("-n", "--nproc-per-node", dest="num_processes", type=int, required=True,
                   help="workers per node (one per GPU)")
    p.add_argument("--spares", type=int, default=None,
                   help=f"nodes of the allocation kept in reserve (default ${SPARES} or 0)")
    p.add_argument("--port", type=int, default=29400, help="the coordination service's port on the batch node")
    p.add_argument("--run-dir", default=None,
                   help="on a filesystem every node sees (default $SLURM_SUBMIT_DIR/runs/$SLURM_JOB_ID: "
                        "a requeued job resumes there)")
    p.add_argument("--agent-args", default=None,
                   help=f"more jaxft launch options for every agent, one string (default ${AGENT_ARGS})")
    p.add_argument("--heartbeat-timeout", type=int, default=10, help="the coordination service's, seconds")
    p.add_argument("--node-timeout", type=float, default=PlanOptions.node_timeout_s,
                   help="seconds of an agent's silence that lose its node")
    p.add_argument("--start-timeout", type=float, default=PlanOptions.start_timeout_s,
                   help="seconds a new agent has to send its first heartbeat")
    p.add_argument("--retry-after", type=float, default=PlanOptions.retry_s,
                   help="seconds before a lost node is tried again (without spares)")
    p.add_argument("--max-replacements", type=int, default=PlanOptions.max_replacements,
                   help="new agents per rank before the job ends")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command")

"""``LaunchConfig``: everything ``jaxft launch`` needs, validated before anything starts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence

from jaxft.errors import LaunchError, TimeoutsError
from jaxft.faults import FaultRule, parse_rules
from jaxft.net import interface_problem
from jaxft.supervisor import crashloop
from jaxft.supervisor.console import CONSOLE_MODES
from jaxft.timeouts import Timeouts

RESTART_POLICIES = ("never", "on-failure", "all")
RUNS_DIR_ENV = "JAXFT_RUNS_DIR"  # where the run dirs of launches without --run-dir go
DEFAULT_RUNS_DIR = "jaxft-runs"  # ... when it is not set: under the working directory
_PYTHON_OPTIONS_WITH_VALUE = ("-W", "-X")  # python -X importtime train.py


@dataclasses.dataclass
class LaunchConfig:
    """Everything ``jaxft launch`` needs; validated by :meth:`validate`."""

    num_processes: int  # workers on this node (--nproc-per-node; -n on a single node)
    command: Sequence[str]
    restart: str = "never"
    max_restarts: int = 10
    max_setup_crashes: int = crashloop.DEFAULT_LIMIT  # lives in a row crashing before a commit; 0: no limit
    faults: Sequence[str] = ()
    run_dir: str | None = None
    heartbeat_timeout: int | None = None  # shortcuts for --timeout heartbeat=S / collective=S
    collective_timeout: int | None = None
    port: int = 0
    bind: str | None = None  # where a hosted service listens (default loopback; all interfaces for --host-coordinator)
    gpus: Sequence[int] | None = None  # one local device id per process
    grace_s: float = 5.0  # SIGTERM -> SIGKILL bound at shutdown
    restart_delay_s: float = 0.0  # wait this long before restarting a dead worker
    hung_after_s: float | None = None  # a SIGSTOPped worker counts as dead after this
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    timeouts: Sequence[str] = ()  # NAME=SECONDS settings of jaxft.Timeouts (--timeout)
    nnodes: int = 1
    node_rank: int = 0
    coordinator: str | None = None  # HOST:PORT of the service (another node's, or a `jaxft coordinator`)
    host_coordinator: bool = False  # this agent hosts the service at --coordinator's port
    gloo_interface: str | None = None  # network interface of the CPU collectives
    checkpoint_on_stop: bool = False  # on SIGINT/SIGTERM workers save a last checkpoint before exiting
    nice_restarts: int = 0  # a restarted worker sets up this much nicer, until it joins (jaxft.priority)
    console: str = "raw"  # progress: logs per process + progress line (the CLI's default); raw: prefixed stream
    progress_every: float = 10.0  # seconds between plain progress lines when stdout is not a terminal

    @property
    def total_processes(self) -> int:
        return self.nnodes * self.num_processes

    @property
    def first_process(self) -> int:
        """Global id of this node's first worker."""
        return self.node_rank * self.num_processes

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
        if self.max_setup_crashes < 0:
            raise LaunchError("--max-setup-crashes must be >= 0 (0: no limit)")
        if any(t is not None and t < 1 for t in (self.heartbeat_timeout, self.collective_timeout)):
            raise LaunchError("--heartbeat-timeout and --collective-timeout must be >= 1 second")
        if self.gpus is not None and len(self.gpus) != self.num_processes:
            raise LaunchError(f"{len(self.gpus)} GPUs given for {self.num_processes} processes; "
                              "jaxft runs one process per GPU")
        if self.nnodes < 1:
            raise LaunchError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.coordinator:
            raise LaunchError("--nnodes > 1 needs --coordinator HOST:PORT (the node that hosts it passes "
                              "--host-coordinator too; or run jaxft coordinator separately)")
        if self.host_coordinator and not self.coordinator:
            raise LaunchError("--host-coordinator needs --coordinator HOST:PORT (the address the workers dial)")
        if self.coordinator:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise LaunchError(f"--coordinator must be HOST:PORT, got {self.coordinator!r}")
        if not 0 <= self.port < 65536:
            raise LaunchError(f"--port must be in 0..65535 (0: a free one), got {self.port}")
        if self.grace_s < 0:
            raise LaunchError(f"--grace must be >= 0, got {self.grace_s:g}")
        if self.run_dir is not None:
            check_run_dir(self.run_dir)
        if self.gloo_interface and (problem := interface_problem(self.gloo_interface)):
            raise LaunchError(f"--gloo-interface: {problem}")
        self.resolved_timeouts()
        if self.console not in CONSOLE_MODES:
            raise LaunchError(f"--console must be one of {CONSOLE_MODES}, got {self.console!r}")
        rules = parse_rules(list(self.faults))
        total = self.total_processes
        for rule in rules:
            if rule.process is not None and not 0 <= rule.process < total:
                raise LaunchError(f"fault {rule.spec!r}: process {rule.process} does not exist "
                                  f"(processes are 0..{total - 1})")
        return rules


def default_run_dir(command: Sequence[str], cwd: str | None = None,
                    environ: Mapping[str, str] = os.environ) -> str:
    """The run dir of a launch without ``--run-dir``: ``<runs>/<program>-<hash>``, where
    ``<runs>`` is ``$JAXFT_RUNS_DIR`` or ``./jaxft-runs`` and ``<hash>`` the first 12 hex
    digits of the SHA-256 of the working directory and the worker command.

    Deterministic, so that a relaunch of the same command from the same directory finds its
    events and checkpoints (``$JAXFT_RUN_DIR/checkpoints``) and resumes, where a fresh
    temporary directory per launch could not; another command gets another one."""
    cwd = os.path.realpath(cwd or os.getcwd())
    key = json.dumps([cwd, [os.fspath(a) for a in command]])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    runs = environ.get(RUNS_DIR_ENV) or DEFAULT_RUNS_DIR
    return os.path.join(runs, f"{_program_name(command)}-{digest}")


def _program_name(command: Sequence[str]) -> str:
    """A readable name for a command's run dir: the script or module a Python command runs
    (``train`` for ``python train.py``, ``pkg.mod`` for ``python -m pkg.mod``), else the
    program's own name."""
    words = [os.fspath(a) for a in command]
    name = os.path.basename(words[0]) if words else "run"
    if re.fullmatch(r"python[0-9.]*", name):
        rest = iter(words[1:])
        for word in rest:
            if word == "-m":
                name = next(rest, name)
                break
            if word == "-c" or word == "-":
                break
            if word in _PYTHON_OPTIONS_WITH_VALUE:
                next(rest, None)
            elif not word.startswith("-"):
                name = os.path.splitext(os.path.basename(word))[0]
                break
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:40].strip("._") or "run"


def check_run_dir(run_dir: str, what: str = "--run-dir", hint: str = "") -> None:
    """Create ``run_dir`` (or find it) and make sure it is a writable directory; ``what``
    names it in the error, ``hint`` ends it."""
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:
        raise LaunchError(f"{what} {run_dir!r}: cannot create it ({e.strerror or e}){hint}") from None
    if not os.path.isdir(run_dir) or not os.access(run_dir, os.W_OK | os.X_OK):
        raise LaunchError(f"{what} {run_dir!r} is not a writable directory{hint}")

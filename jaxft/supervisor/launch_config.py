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
from jaxft.supervisor.console import CONSOLE_MODES
from jaxft.supervisor.restarts import RestartPolicy
from jaxft.timeouts import Timeouts

RUNS_DIR_ENV = "JAXFT_RUNS_DIR"  # where the run dirs of launches without --run-dir go
DEFAULT_RUNS_DIR = "jaxft-runs"  # ... when it is not set: under the working directory
_PYTHON_OPTIONS_WITH_VALUE = ("-W", "-X")  # python -X importtime train.py


@dataclasses.dataclass(frozen=True)
class Service:
    """Where the coordination service is: hosted by this launcher (the default, or with
    ``host=True`` at ``address``'s port), or another node's / a ``jaxft coordinator``'s at ``address``.

    Attributes:
      address: HOST:PORT the workers dial (``--coordinator``); None: a service hosted here.
      host: this agent hosts the service at ``address``'s port (``--host-coordinator``).
      port: the port of a service hosted here without ``address`` (0: a free one).
      bind: where a hosted service listens (default loopback; all interfaces with ``host``).
    """

    address: str | None = None
    host: bool = False
    port: int = 0
    bind: str | None = None

    @property
    def external(self) -> bool:
        """The service runs elsewhere: this launcher only dials it."""
        return bool(self.address) and not self.host

    def validate(self) -> None:
        if self.host and not self.address:
            raise LaunchError("--host-coordinator needs --coordinator HOST:PORT (the address the workers dial)")
        if self.address:
            host, _, port = self.address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise LaunchError(f"--coordinator must be HOST:PORT, got {self.address!r}")
        if not 0 <= self.port < 65536:
            raise LaunchError(f"--port must be in 0..65535 (0: a free one), got {self.port}")


@dataclasses.dataclass(frozen=True)
class Topology:
    """What processes run where.

    Attributes:
      num_processes: workers on this node (``--nproc-per-node``; ``-n`` on a single node), its
        spares included.
      nnodes: nodes in the job, one launcher (agent) each.
      node_rank: this node's rank in ``[0, nnodes)``; its workers are processes
        ``node_rank * num_processes + local``.
      gpus: one local device id per worker (None: no GPU assignment).
      gloo_interface: network interface of the CPU collectives.
      service: where the coordination service is.
      spares: of each node's workers, how many (its last ones) start as hot spares
        (:mod:`jaxft.core.spares`; ``--spares``).
    """

    num_processes: int
    nnodes: int = 1
    node_rank: int = 0
    gpus: Sequence[int] | None = None
    gloo_interface: str | None = None
    service: Service = Service()
    spares: int = 0

    @property
    def spare_ids(self) -> tuple[int, ...]:
        """The processes of the whole job that start as spares (the last ``spares`` of each node)."""
        n, k = self.num_processes, self.spares
        return tuple(r * n + i for r in range(self.nnodes) for i in range(n - k, n))

    @property
    def total_processes(self) -> int:
        return self.nnodes * self.num_processes

    @property
    def first_process(self) -> int:
        """Global id of this node's first worker."""
        return self.node_rank * self.num_processes

    def validate(self) -> None:
        if not 0 <= self.spares < self.num_processes:
            raise LaunchError(f"--spares {self.spares} leaves no worker to train on a node of {self.num_processes} "
                              "(--spares K starts K workers more than -n)")
        if self.gpus is not None and len(self.gpus) != self.num_processes:
            raise LaunchError(f"{len(self.gpus)} GPUs given for {self.num_processes} processes; "
                              "jaxft runs one process per GPU")
        if self.nnodes < 1:
            raise LaunchError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.service.address:
            raise LaunchError("--nnodes > 1 needs --coordinator HOST:PORT (the node that hosts it passes "
                              "--host-coordinator too; or run jaxft coordinator separately)")
        self.service.validate()
        if self.gloo_interface and (problem := interface_problem(self.gloo_interface)):
            raise LaunchError(f"--gloo-interface: {problem}")


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """How a launch ends its workers (Ctrl-C, SIGTERM, the end of the job).

    Attributes:
      grace_s: SIGTERM -> SIGKILL bound.
      checkpoint_on_stop: on SIGINT/SIGTERM the workers save a last checkpoint before exiting.
    """

    grace_s: float = 5.0
    checkpoint_on_stop: bool = False

    def validate(self) -> None:
        if self.grace_s < 0:
            raise LaunchError(f"--grace must be >= 0, got {self.grace_s:g}")


@dataclasses.dataclass(frozen=True)
class Output:
    """Where a launch's record goes and what a person sees of it.

    Attributes:
      run_dir: events, summary, logs and the workers' ``$JAXFT_RUN_DIR`` (checkpoints); None:
        :func:`default_run_dir` (the launcher fills it in).
      console: ``raw`` (every worker line, prefixed) or ``progress`` (logs per process + a
        progress line; the CLI's default).
      progress_every: seconds between plain progress lines when stdout is not a terminal.
    """

    run_dir: str | None = None
    console: str = "raw"
    progress_every: float = 10.0

    def validate(self) -> None:
        if self.run_dir is not None:
            check_run_dir(self.run_dir)
        if self.console not in CONSOLE_MODES:
            raise LaunchError(f"--console must be one of {CONSOLE_MODES}, got {self.console!r}")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything ``jaxft launch`` needs; validated by :meth:`validate`.

    Attributes:
      command: the worker command.
      topology: how many workers, where, on which devices, and where the service is.
      restart: when dead workers come back (:class:`RestartPolicy`, with its decision).
      shutdown: how the workers are ended.
      output: the run dir and the console.
      faults: fault specs to inject (:mod:`jaxft.faults`).
      timeouts: ``NAME=SECONDS`` settings of :class:`jaxft.Timeouts`, later ones win (``--timeout``).
      extra_env: set in every worker's environment.
    """

    command: Sequence[str]
    topology: Topology
    restart: RestartPolicy = RestartPolicy()
    shutdown: Shutdown = Shutdown()
    output: Output = Output()
    faults: Sequence[str] = ()
    timeouts: Sequence[str] = ()
    extra_env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def resolved_timeouts(self) -> Timeouts:
        """The workers' :class:`~jaxft.Timeouts`: the defaults with the ``timeouts`` settings applied."""
        try:
            return Timeouts().updated(list(self.timeouts))
        except TimeoutsError as e:
            raise LaunchError(str(e)) from None

    def validate(self) -> list[FaultRule]:
        """Check every part (a :class:`LaunchError` names the flag at fault); the fault rules."""
        t = self.topology
        if t.num_processes < 1:
            raise LaunchError(f"-n must be >= 1, got {t.num_processes}")
        if not self.command:
            raise LaunchError("no worker command given; usage: jaxft launch -n N [options] -- COMMAND ARGS...")
        exe = self.command[0]
        if shutil.which(exe) is None:
            raise LaunchError(f"worker command {exe!r} not found (not on PATH, or not executable)")
        self.restart.validate()
        t.validate()
        self.shutdown.validate()
        self.output.validate()
        self.resolved_timeouts()
        rules = parse_rules(list(self.faults))
        total = t.total_processes
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

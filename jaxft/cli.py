"""``jaxft`` command line: ``launch``, ``coordinator``, ``slurm``, ``report``, ``bench`` (thin: parse, then call)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from jaxft import bench
from jaxft.coordinator import DEFAULT_HEARTBEAT_TIMEOUT, Coordinator, serve_forever
from jaxft.errors import Error, LaunchError
from jaxft.supervisor import crashloop, report, slurm
from jaxft.supervisor.launch_config import LaunchConfig, Output, Service, Shutdown, Topology
from jaxft.supervisor.launcher import Launcher
from jaxft.supervisor.procs import detect_gpus
from jaxft.supervisor.restarts import RESTART_POLICIES, RestartPolicy
from jaxft.timeouts import Timeouts


def _gpus(value: str) -> list[int] | str:
    if value in ("auto", "all", "none"):
        return value
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes auto, all, none or a list like 0,1,2; got {value!r}") from None


def _add_launch(sub) -> None:
    p = sub.add_parser("launch", help="run N workers under a supervisor with restarts and fault injection",
                       usage="jaxft launch -n N [options] -- COMMAND ARGS...\n"
                             "       jaxft launch --nnodes N --node-rank R [--nproc-per-node K] "
                             "--coordinator HOST:PORT [--host-coordinator] [options] -- COMMAND ARGS...")
    p.add_argument("-n", "--num-processes", "--nproc-per-node", dest="num_processes", type=int, default=None,
                   help="worker processes on this node (default: one per local GPU; required without GPUs)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job, one agent each (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank in [0, nnodes) (default 0)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="the coordination service the workers dial (a jaxft coordinator, or the agent "
                        "started with --host-coordinator); required with --nnodes > 1")
    p.add_argument("--host-coordinator", action="store_true",
                   help="this agent hosts the service, listening on --coordinator's port on --bind")
    p.add_argument("--gloo-interface", default=None, metavar="IFACE",
                   help="network interface the workers' CPU collectives use (e.g. eth0); needed where the "
                        "hostname resolves to loopback")
    p.add_argument("--restart", choices=RESTART_POLICIES, default="never",
                   help="restart a dead worker with the same process id (default: never)")
    p.add_argument("--restart-delay", type=float, default=0.0, help="seconds to wait before a restart")
    p.add_argument("--max-restarts", type=int, default=10, help="restarts allowed per process")
    p.add_argument("--max-setup-crashes", type=int, default=crashloop.DEFAULT_LIMIT, metavar="K",
                   help="stop restarting a process whose last K lives each crashed before committing a step "
                        f"with the same exit status (a set-up bug, not a fault; default {crashloop.DEFAULT_LIMIT}, "
                        "0: no limit)")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="inject a fault, e.g. kill:process=1:step=5[:phase=after-grad], "
                        "kill-all:step=13, stop:process=2:step=7, kill:process=0:after=4.5s")
    p.add_argument("--run-dir", default=None,
                   help="events.jsonl, summary.json, logs/ and the workers' $JAXFT_RUN_DIR (checkpoints, "
                        "compilation cache); default: $JAXFT_RUNS_DIR (or ./jaxft-runs)/PROGRAM-HASH, named "
                        "after the worker command and the working directory, so that a relaunch of the same "
                        "command resumes there")
    p.add_argument("--heartbeat-timeout", type=int, default=None,
                   help=f"seconds without heartbeats before a worker counts as dead (default {Timeouts.heartbeat:g})")
    p.add_argument("--collective-timeout", type=int, default=None,
                   help=f"seconds before a CPU collective with a dead peer fails (default {Timeouts.collective:g})")
    p.add_argument("--timeout", action="append", default=[], metavar="NAME=SECONDS",
                   help="set one bound of jaxft.Timeouts for the workers (repeatable); names: "
                        + ", ".join(f"{n} (default {getattr(Timeouts, n):g})" for n in Timeouts.names()))
    p.add_argument("--port", type=int, default=0,
                   help="coordinator port (default: a free one, below the kernel's ephemeral range)")
    p.add_argument("--bind", default=None,
                   help="where a hosted coordinator listens (default: loopback; all interfaces with "
                        "--host-coordinator)")
    p.add_argument("--gpus", type=_gpus, default="auto",
                   help="auto (default: one worker per local GPU when nvidia-smi lists any and JAX_PLATFORMS "
                        "does not start with cpu, else CPU), "
                        "all (GPUs required), none (CPU workers: JAX_PLATFORMS=cpu unless set), or ids like 0,1,2")
    p.add_argument("--grace", type=float, default=5.0, help="SIGTERM -> SIGKILL bound at shutdown, seconds")
    p.add_argument("--nice-restarts", type=int, default=None, metavar="N",
                   help="start a restarted worker N nicer and give it its priority back as it joins the step, "
                   "where that can be undone (root or RLIMIT_NICE); 0: off (default: 19 with --spares, where a "
                   "restart becomes a spare that nobody waits for; else 0)")
    p.add_argument("--early-connect", action=argparse.BooleanOptionalAction, default=True,
                   help="one node: a restart connects once every member dropped its previous life, not "
                        "heartbeat + 1.5 s after its death (restarts back ~3.5 s sooner; default on; "
                        "--no-early-connect: always wait out the heartbeat)")
    p.add_argument("--standby", action=argparse.BooleanOptionalAction, default=True,
                   help="keep one worker interpreter per node started ahead, its imports (jax, jaxft) done, "
                        "that the next restart becomes (a 'python -m module' or 'python script.py' command "
                        "only; default on; --no-standby: every restart starts a fresh interpreter)")
    p.add_argument("--spares", type=int, default=0, metavar="K",
                   help="hot spares: K workers more per node, set up and compiled but out of the steps until "
                        "a member dies; one then takes its place before the next commit (default 0)")
    p.add_argument("--checkpoint-on-stop", action="store_true",
                   help="on Ctrl-C/SIGTERM, workers agree on a step, save a last checkpoint there (with an "
                        "ElasticCheckpointer), then exit; raise --grace to leave time for the write")
    p.add_argument("--console", choices=("progress", "raw"), default="progress",
                   help="progress (default): worker output to RUN_DIR/logs/, a progress line, one line per "
                        "incident and a summary; "
                        "raw: every worker line on the console, prefixed with its process id")
    p.add_argument("--verbose", "-v", action="store_true", help="same as --console raw")
    p.add_argument("--progress-every", type=float, default=10.0,
                   help="seconds between progress lines when stdout is not a terminal (default 10)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command")


def _add_coordinator(sub) -> None:
    p = sub.add_parser("coordinator", help="run only the recoverable coordination service")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--bind", default="127.0.0.1", help="bind address (default: loopback)")
    p.add_argument("--heartbeat-timeout", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT)


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported in one line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxft", description="Fault-tolerant multi-controller JAX.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_launch(sub)
    _add_coordinator(sub)
    slurm.add_parser(sub)
    bench.add_parser(sub)
    r = sub.add_parser("report", help="summarise a run directory's events (with its goodput), or compare runs")
    r.add_argument("run_dir", nargs="+", help="a run directory; two or more are compared side by side")
    r.add_argument("--json", action="store_true", help="print the figures as JSON")
    r.add_argument("--png", default=None, help="where to write the picture (default RUN_DIR/report.png)")
    return parser


def _launch(args, parser) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    n, gpus, extra_env = _workers(args)
    config = LaunchConfig(
        command=command,
        topology=Topology(n, nnodes=args.nnodes, node_rank=args.node_rank, gpus=gpus, spares=args.spares,
                          gloo_interface=args.gloo_interface,
                          service=Service(args.coordinator, host=args.host_coordinator, port=args.port,
                                          bind=args.bind)),
        restart=RestartPolicy(args.restart, max_restarts=args.max_restarts, delay_s=args.restart_delay,
                              max_setup_crashes=args.max_setup_crashes, nice_restarts=_nice_restarts(args),
                              early_connect=args.early_connect, standby=args.standby),
        shutdown=Shutdown(args.grace, checkpoint_on_stop=args.checkpoint_on_stop),
        output=Output(args.run_dir, console="raw" if args.verbose else args.console,
                      progress_every=args.progress_every),
        faults=tuple(args.fault), timeouts=_timeouts(args), extra_env=extra_env)
    return Launcher(config).run()


def _nice_restarts(args) -> int:
    """``--nice-restarts``, by default 19 with spares (a restart then sets up as the next spare:
    nobody waits for it, and at full priority its set-up slowed the members' steps on shared
    cores; measured: docs/benchmarks.md) and 0 without."""
    if args.nice_restarts is not None:
        return args.nice_restarts
    return 19 if args.spares else 0


def _workers(args) -> tuple[int, list[int] | None, dict[str, str]]:
    """How many workers on this node (``--spares`` included), their GPUs (None: no GPU
    assignment), and what their environment must add for it."""
    if args.spares < 0:
        raise LaunchError(f"--spares must be >= 0, got {args.spares}")
    gpus = args.gpus
    extra_env = {}
    if gpus == "none" and "JAX_PLATFORMS" not in os.environ:
        # CPU workers even where jax would pick a GPU: without this each worker's jax takes
        # the node's default GPU, every one the same.
        extra_env["JAX_PLATFORMS"] = "cpu"
    if gpus == "auto" and os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        gpus = None  # the workers will run on CPU whatever the node has: no GPU assignment
    if gpus in ("auto", "all"):
        found = detect_gpus()
        if gpus == "all" and not found:
            raise LaunchError("--gpus all: no NVIDIA GPU found (nvidia-smi -L lists none)")
        gpus = found or None
    elif gpus == "none":
        gpus = None
    n = args.num_processes
    if n is None:
        if gpus is None:
            raise LaunchError("-n is required for CPU workers (no GPU found, --gpus none, or JAX_PLATFORMS=cpu)")
        n = len(gpus) - args.spares  # (the spares take GPUs too)
    n += args.spares
    if gpus is not None and n > len(gpus):
        what = f"-n {n} workers" if not args.spares else f"{n} workers ({args.spares} of them spares)"
        raise LaunchError(f"{what} but this node has {len(gpus)} GPU(s) ({','.join(map(str, gpus))}): jaxft runs "
                          f"one worker per GPU; lower -n{' or --spares' if args.spares else ''}, or pass --gpus none "
                          "to run on CPU")
    elif gpus is not None:
        gpus = gpus[:n]
    return n, gpus, extra_env


def _timeouts(args) -> tuple[str, ...]:
    """The workers' ``NAME=SECONDS`` settings: ``--timeout``'s, then the two shortcut flags
    ``--heartbeat-timeout`` / ``--collective-timeout`` (which win)."""
    shortcuts = {"heartbeat": args.heartbeat_timeout, "collective": args.collective_timeout}
    if any(v is not None and v < 1 for v in shortcuts.values()):
        raise LaunchError("--heartbeat-timeout and --collective-timeout must be >= 1 second")
    return (*args.timeout, *(f"{name}={v}" for name, v in shortcuts.items() if v is not None))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.cmd == "launch":
            return _launch(args, parser)
        if args.cmd == "slurm":
            return slurm.SlurmSupervisor(slurm.config_from_args(args), slurm.Allocation.from_env()).run()
        if args.cmd == "report":
            return report.main(args.run_dir, args.json, args.png)
        if args.cmd == "bench":
            return bench.run(args)
        if args.cmd == "coordinator":
            coord = Coordinator(args.num_processes, port=args.port, bind=args.bind,
                                heartbeat_timeout=args.heartbeat_timeout)
            serve_forever(coord, f"jaxft coordinator listening on {coord.address} "
                                 f"for {args.num_processes} processes")
            return 0
    except Error as e:
        print(f"jaxft {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())

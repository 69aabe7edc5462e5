"""Shared helpers for the jaxft tests: run real processes, read what they left behind.

Everything here starts real OS processes (``jaxft launch``, ``jaxft coordinator``, small
Python scripts) with the interpreter running the tests, so the suite exercises exactly
the installed package in the current virtual environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

import jaxft
from jaxft import net, protocol

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
JAXFT = [PYTHON, "-m", "jaxft.cli"]  # the `jaxft` console script, run by this interpreter
ALLREDUCE_WORKER = REPO / "tests" / "workers" / "allreduce.py"
RUNS_DIR_ENV = "JAXFT_RUNS_DIR"  # where launches without --run-dir put their run dirs
CACHE_ENV = protocol.COMPILATION_CACHE  # jax's persistent compilation cache the session's runs share


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without anything jaxft or XLA would pick up from an outer run; it keeps
    ``JAXFT_RUNS_DIR`` (conftest.py points it at a temporary directory: launches without
    ``--run-dir`` must not leave their default run dirs in the repository)."""
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith("JAXFT_") or k in (RUNS_DIR_ENV, CACHE_ENV)) and k not in ("XLA_FLAGS", "JAX_PLATFORMS")
           and not k.startswith("XLA_PYTHON_CLIENT_")}
    env["JAX_PLATFORMS"] = "cpu"  # the suite runs on CPU, also on a machine with a GPU
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@dataclasses.dataclass
class Result:
    returncode: int | None  # (None: it timed out)
    stdout: str
    stderr: str
    elapsed: float
    args: Sequence[str]

    def describe(self) -> str:
        """A failure message with everything needed to see what happened."""
        return (f"command: {' '.join(map(str, self.args))}\nreturncode: {self.returncode}, "
                f"elapsed {self.elapsed:.1f} s\n--- stdout ---\n{self.stdout[-6000:]}\n"
                f"--- stderr ---\n{self.stderr[-6000:]}")


DEADLINE: float | None = None  # (monotonic) the running test's own timeout less STACKS_MARGIN_S (conftest)
STACKS_MARGIN_S = 30.0  # time left to dump the stacks of a command that hangs


def run(args: Sequence[str], timeout: float = 60, env: dict | None = None,
        cwd: str | os.PathLike | None = None) -> Result:
    """Run a command to completion and time it. Past ``timeout`` (or :data:`DEADLINE`, if
    sooner) the test fails with what the command printed so far and the Python stacks of its
    process tree (:func:`stacks_of`), then the command is killed: a hang says where it waits."""
    args = [str(a) for a in args]
    t0 = time.monotonic()
    if DEADLINE is not None:
        timeout = max(1.0, min(timeout, DEADLINE - t0))
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=clean_env() if env is None else env, cwd=cwd or REPO,
                          stdin=subprocess.DEVNULL) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = stacks_of(proc.pid)
            for pid in [*descendants(proc.pid), proc.pid]:  # (a child holding its pipes: killed too)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            out, err = proc.communicate()
            result = Result(None, out, err, time.monotonic() - t0, args)
            pytest.fail(f"timed out after {timeout:.1f} s\n{result.describe()}\n--- stacks ---\n{stacks}",
                        pytrace=False)
    return Result(proc.returncode, out, err, time.monotonic() - t0, args)


def descendants(pid: int) -> list[int]:
    """``pid``'s child processes, their children and so on (Linux ``/proc``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                kids = [int(c) for c in task.read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def stacks_of(pid: int, per_process_s: float = 15) -> str:
    """The Python stacks of ``pid`` and its descendants (``py-spy dump``, where installed;
    else their command lines), for a test that timed out."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    out = []
    for p in [pid, *descendants(pid)]:
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:300]
        except OSError:
            continue
        out.append(f"=== pid {p}: {cmd}")
        if spy and "python" in cmd:
            try:
                r = subprocess.run([spy, "dump", "--pid", str(p)], capture_output=True, text=True,
                                   timeout=per_process_s)
                out.append((r.stdout + r.stderr)[-4000:])
                # the main thread's locals too (which set a liveness query waits in, say)
                r = subprocess.run([spy, "dump", "--locals", "--pid", str(p)], capture_output=True, text=True,
                                   timeout=per_process_s)
                blocks = r.stdout.split("\nThread ")[1:]
                main = next((b for b in blocks if '"MainThread"' in b.split("\n", 1)[0]), blocks[0] if blocks else "")
                out.append("main thread's locals:\n" + main[:3000])
            except subprocess.TimeoutExpired:
                out.append("(py-spy timed out)")
    return "\n".join(out) if out else "(no processes left)"


def run_jaxft(*args, timeout: float = 60, env: dict | None = None) -> Result:
    """``jaxft ARGS...`` (the CLI), run to completion."""
    return run([*JAXFT, *args], timeout=timeout, env=env)


def run_python(code: str, *args, timeout: float = 60, env: dict | None = None) -> Result:
    """``python -c CODE ARGS...`` with this interpreter."""
    return run([PYTHON, "-c", code, *args], timeout=timeout, env=env)


def launch(num_processes: int, command: Sequence[str], *options: str, run_dir: str | os.PathLike | None = None,
           timeout: float = 90, console: str = "raw", env: dict | None = None) -> Result:
    """``jaxft launch -n N --console C [options] [--run-dir R] -- COMMAND``, run to completion.

    ``console="raw"`` (the default here) keeps every worker line on stdout, prefixed with its
    process id, which is what most tests read. ``env``: the launcher's environment (default
    :func:`clean_env`)."""
    extra = ["--console", console] + (["--run-dir", str(run_dir)] if run_dir is not None else [])
    return run_jaxft("launch", "-n", str(num_processes), *options, *extra, "--", *command,
                     timeout=timeout, env=env)


def new_function() -> Callable:
    """A new function object at each call (a closure): one qualified name, another address."""
    def step(x):
        return x
    return step


def events(run_dir: str | os.PathLike) -> list[dict]:
    return jaxft.read_events(run_dir)


def summary(run_dir: str | os.PathLike) -> dict:
    with open(Path(run_dir) / "summary.json") as f:
        return json.load(f)


def free_port() -> int:
    """A loopback port free now, outside the ephemeral range (:func:`jaxft.net.free_port`)."""
    return net.free_port()


@contextlib.contextmanager
def busy_port() -> Iterator[int]:
    """A loopback port that this process holds bound and listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def processes_with(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of live processes whose argv contains ``marker``.

    ``pgrep -af`` when it exists, else a scan of /proc (zombies have no command line
    and so never match, as with pgrep).
    """
    if shutil.which("pgrep"):
        out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
        found = []
        for line in out.splitlines():
            pid, _, cmd = line.partition(" ")
            if pid.isdigit():
                found.append((int(pid), cmd))
        return found
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if marker in cmd:
            found.append((int(entry), cmd))
    return found


def kill_marked(marker: str) -> list[tuple[int, str]]:
    """SIGKILL (by pid) every process carrying ``marker``; returns what was found."""
    found = processes_with(marker)
    for pid, _ in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return found


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.05,
             what: str = "condition"):
    """Poll ``predicate`` until it is truthy; its value, or AssertionError at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def read_line(stream, timeout: float) -> str:
    """One line from a pipe (text or bytes), or '' at ``timeout``/EOF."""
    deadline = time.monotonic() + timeout
    buf = b""
    fd = stream.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 1)
        if not chunk:
            break
        buf += chunk
        if chunk == b"\n":
            break
    return buf.decode(errors="replace")


def is_stopped(pid: int) -> bool:
    """True when ``pid`` is in state T (stopped by a signal)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def started(args: Sequence[str], env: dict | None = None, **popen) -> Iterator[subprocess.Popen]:
    """A background process that is SIGKILLed (if still alive) and reaped on exit."""
    proc = subprocess.Popen([str(a) for a in args], env=clean_env() if env is None else env, cwd=REPO,
                            stdin=subprocess.DEVNULL, **popen)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def by_event(evts: list[dict], name: str, **match) -> list[dict]:
    """The events called ``name`` whose fields equal ``match``."""
    return [e for e in evts if e["event"] == name and all(e.get(k) == v for k, v in match.items())]


# -- training runs (examples/mlp.py and friends under jaxft launch) ---------------------------

MLP = str(REPO / "examples" / "mlp.py")
EXACT = ("--reduction", "exact", "--exact_chunks", "8")  # bitwise independent of the width


def train(run_dir: str | os.PathLike, *worker: str, n: int = 3, faults: Sequence[str] = (),
          restart: str = "never", extra: Sequence[str] = (), timeout: float = 240, console: str = "raw"
          ) -> tuple[Result, list[dict]]:
    """``jaxft launch -n N --run-dir R --restart P [--fault F]... -- python WORKER...``;
    returns the result and the run's events."""
    options = ["--restart", restart, *extra]
    for f in faults:
        options += ["--fault", f]
    result = launch(n, [PYTHON, *worker], *options, run_dir=run_dir, timeout=timeout, console=console)
    return result, events(run_dir)


def finals(evts: list[dict]) -> list[dict]:
    return by_event(evts, "final")


def too_late_to_rejoin(evts: list[dict], process: int) -> bool:
    """Whether ``process``'s last life came after the run: it committed nothing and exited 0
    (with ready admission a process restarted near the end is still setting up when the others
    finish; it then exits 0 instead of training alone)."""
    lives = by_event(evts, "launch", process=process)
    if not lives:
        return False
    last = max(e["incarnation"] for e in lives)
    exits = by_event(evts, "exit", process=process, incarnation=last)
    return (not by_event(evts, "commit", process=process, incarnation=last)
            and bool(exits) and exits[-1].get("code") == 0)


def commits_by_step(evts: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in by_event(evts, "commit"):
        out.setdefault(e["step"], []).append(e)
    return out


def rel(a: float, b: float) -> float:
    """Relative difference of ``a`` from ``b``."""
    return abs(a - b) / max(abs(b), 1e-12)


def check_agreed_run(evts: list[dict], steps: int, n: int) -> dict[int, list[dict]]:
    """Every step 0..steps-1 committed with one member set, and ``n`` finals with one
    ``params_sha256``; returns the commits by step."""
    by_step = commits_by_step(evts)
    assert sorted(by_step) == list(range(steps)), sorted(by_step)
    for step, commits in by_step.items():
        assert len({tuple(c["members"]) for c in commits}) == 1, f"step {step}: members disagree: {commits}"
    f = finals(evts)
    assert len(f) == n and len({x["params_sha256"] for x in f}) == 1, f
    return by_step


def stop_with_checkpoint(run: Path, worker: Sequence[str], n: int = 2) -> tuple[list[dict], int]:
    """``jaxft launch -n N --checkpoint-on-stop -- WORKER...`` SIGTERMed once step 5 committed:
    checks that every process stopped at one step, saved a checkpoint there and exited on
    SIGTERM with no traceback; returns the run's events and that step."""
    args = [*JAXFT, "launch", "-n", str(n), "--run-dir", str(run), "--grace", "30", "--checkpoint-on-stop",
            "--console", "raw", "--", *worker]
    with started(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        wait_for(lambda: by_event(events(run), "commit", step=5), timeout=120, interval=0.2, what="step 5")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "ignored SIGTERM" not in out and "Traceback" not in out, out
    ev = events(run)
    stopped = by_event(ev, "stopped")
    assert sorted(e["process"] for e in stopped) == list(range(n)) and len({e["step"] for e in stopped}) == 1, stopped
    step = stopped[0]["step"]
    assert {e["process"] for e in by_event(ev, "checkpoint_saved", step=step)} == set(range(n)), out
    assert {e.get("code") for e in summary(run)["exits"]} == {128 + signal.SIGTERM}
    return ev, step


def one_process_shas(tmp_path_factory, *worker: str, absent: Sequence[str]) -> Callable[[int], str]:
    """``steps -> params_sha256`` of ``MLP WORKER...`` run by one process (each run once, then
    remembered): the reference of runs that must end with the same bits. ``absent``: keys the
    reference's ``final`` event must not carry (it runs without the options under test)."""
    shas: dict[int, str] = {}

    def sha(steps: int) -> str:
        if steps not in shas:
            d = tmp_path_factory.mktemp("seq")
            proc, evts = train(d, MLP, "--steps", str(steps), *worker, n=1)
            assert proc.returncode == 0, proc.describe()
            (final,) = finals(evts)
            assert not set(absent) & set(final), final
            shas[steps] = final["params_sha256"]
        return shas[steps]

    return sha

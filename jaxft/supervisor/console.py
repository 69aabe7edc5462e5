"""What ``jaxft launch`` shows a person: a progress line, one line per incident, a summary.

Two modes:

* ``progress`` (the CLI's default): each worker's full output goes to
  ``RUN_DIR/logs/process-P.incarnation-I.log`` (the launcher's own messages to
  ``RUN_DIR/logs/launcher.log``); the console shows one live progress line (a ``rich``
  live line on a terminal, a plain line every ``progress_every`` seconds otherwise), one
  line per incident that tells its story, and a summary. Everything is derived from the
  events the workers already write to ``RUN_DIR/events.jsonl``, which a thread tails and
  :class:`~jaxft.supervisor.tracker.RunTracker` folds into figures and stories. A
  worker that exits with an error code shows its last lines; expected deaths never do.
* ``raw``: today's stream, every worker line prefixed with ``[P]`` (``--console raw``).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, TextIO

from jaxft.protocol import Event
from jaxft.supervisor.tracker import RunTracker

if TYPE_CHECKING:
    from rich.live import Live

CONSOLE_MODES = ("progress", "raw")
TAIL_LINES = 25  # worker lines shown when it fails unexpectedly
EXPECTED_EXIT_REASONS = ("terminated by launcher", "killed by --restart all")


def crash_loop_message(e: dict) -> str:
    """The launcher's line for a ``crash_loop`` event (:mod:`jaxft.supervisor.crashloop`)."""
    how = f"exit code {e['code']}" if e.get("code") is not None else str(e.get("signal"))
    what = ("stopping the job (--restart all restarts every worker or none)" if e.get("restart") == "all"
            else "not restarting it")
    return (f"process {e.get('process')} crashed {e.get('crashes')} times in a row before committing a step, "
            f"each time with {how}: a restart repeats it, {what}; see its output "
            "(--max-setup-crashes sets the limit, 0 turns this off)")


class Console:
    """The launcher's output: worker streams, its own messages, and (mode ``progress``) the
    progress line and incident stories tailed from ``events.jsonl``."""

    def __init__(self, mode: str, run_dir: str | None, out: TextIO = sys.stdout,
                 num_processes: int | None = None, progress_every: float = 10.0, tag: str = "[jaxft]"):
        if mode not in CONSOLE_MODES:
            raise ValueError(f"console mode must be one of {CONSOLE_MODES}, got {mode!r}")
        self.mode = mode
        self.tag = tag  # what each line starts with: "[jaxft]", or "[jaxft node R]" for one node's agent of many
        self.run_dir = run_dir
        self.out = out
        self.progress_every = progress_every
        self.tracker = RunTracker(num_processes)
        self._lock = threading.Lock()
        # (process, incarnation) -> its last lines; per life, as a restart starts before the
        # previous life's exit is drained from the events
        self._tails: dict[tuple[int, int], collections.deque] = {}
        self._shown: dict[int, tuple[int, list[str]]] = {}  # process -> (life, last lines) last shown
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._offset = 0
        self._live: Live | None = None
        self._launcher_log: IO[str] | None = None
        self._saved_stderr: int | None = None
        self.logs_dir = os.path.join(run_dir, "logs") if (run_dir and mode == "progress") else None

    @property
    def progress(self) -> bool:
        return self.mode == "progress"

    def _logs(self) -> str:
        """``logs_dir``, which mode ``progress`` has (the launcher always gives a run dir)."""
        assert self.logs_dir is not None, "console mode 'progress' needs a run dir"
        return self.logs_dir

    # -- launcher messages and worker streams ---------------------------------------------------
    def say(self, text: str) -> None:
        """A launcher message: on the console (raw) or in ``logs/launcher.log`` (progress)."""
        with self._lock:
            if self.progress and self.logs_dir:
                if self._launcher_log is None:
                    os.makedirs(self.logs_dir, exist_ok=True)
                    self._launcher_log = open(os.path.join(self.logs_dir, "launcher.log"), "a")  # noqa: SIM115 - kept open
                self._launcher_log.write(f"{time.strftime('%H:%M:%S')} {text}\n")
                self._launcher_log.flush()
            else:
                self.out.write(f"{self.tag} {text}\n")
                self.out.flush()

    def warn(self, text: str) -> None:
        """A launcher message a person must see in every mode (and in ``launcher.log``)."""
        self.say(text)
        if self.progress:
            self._print(f"{self.tag} {text}")

    def _print(self, text: str) -> None:
        with self._lock:
            if self._live is not None:
                self._live.console.print(text, markup=False, highlight=False, soft_wrap=True)
            else:
                self.out.write(text + "\n")
                self.out.flush()

    def pump(self, process: int, incarnation: int, stream) -> None:
        """Copy one worker's output: prefixed to the console (raw) or to its log file."""
        if not self.progress:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                with self._lock:
                    self.out.write(f"[{process}] {line}\n")
                    self.out.flush()
            stream.close()
            return
        tail = self._tails.setdefault((process, incarnation), collections.deque(maxlen=TAIL_LINES))
        logs_dir = self._logs()
        os.makedirs(logs_dir, exist_ok=True)
        path = os.path.join(logs_dir, f"process-{process}.incarnation-{incarnation}.log")
        with open(path, "ab") as f:
            for raw in iter(stream.readline, b""):
                f.write(raw)
                f.flush()
                tail.append(raw.decode(errors="replace").rstrip("\n"))
        stream.close()

    def log_path(self, process: int, incarnation: int) -> str:
        return os.path.join(self.logs_dir or "", f"process-{process}.incarnation-{incarnation}.log")

    # -- the progress thread --------------------------------------------------------------------
    def start(self, run_dir_note: str = "") -> None:
        """Say where the run dir is (with ``run_dir_note``: always; else in mode progress) and
        start the progress line (mode progress)."""
        if not self.progress:
            if run_dir_note:
                self.say(f"run dir {self.run_dir}{run_dir_note}")
            return
        self._print(f"{self.tag} run dir {self.run_dir}{run_dir_note}; worker output in {self.logs_dir}/")
        self._offset = self._events_size()  # a relaunch into a used run dir tells only its own story
        # The launcher's own native stderr (the coordination service's C++ log lines) goes to
        # logs/launcher.log until close(); Python-level errors are printed after close().
        logs_dir = self._logs()
        os.makedirs(logs_dir, exist_ok=True)
        sys.stderr.flush()
        self._saved_stderr = os.dup(2)
        fd = os.open(os.path.join(logs_dir, "launcher.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        if getattr(self.out, "isatty", lambda: False)():
            from rich.console import Console as RichConsole
            from rich.live import Live

            self._live = Live("", console=RichConsole(file=self.out), refresh_per_second=4, transient=True)
            self._live.start()
        self._thread = threading.Thread(target=self._loop, name="jaxft-console", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        last_plain = time.time()
        while not self._stop.wait(0.25):
            self._drain()
            now = time.time()
            if self._live is not None:
                self._live.update(f"{self.tag} {self.tracker.line(now)}")
            elif now - last_plain >= self.progress_every:
                last_plain = now
                self._print(f"{self.tag} {self.tracker.line(now)}")

    def _events_size(self) -> int:
        """How many bytes ``events.jsonl`` holds now (the events of earlier launches)."""
        if not self.run_dir:
            return 0
        try:
            return os.path.getsize(os.path.join(self.run_dir, "events.jsonl"))
        except OSError:
            return 0

    def _drain(self) -> None:
        if not self.run_dir:
            return
        path = os.path.join(self.run_dir, "events.jsonl")
        try:
            with open(path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # a line being written stays for the next read
        self._offset += end
        for line in data[:end].splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            for story in self.tracker.feed(e):
                self._print(f"{self.tag} incident: {story}")
            if e.get("event") == Event.EXIT:
                self._maybe_show_tail(e)
            elif e.get("event") == Event.CRASH_LOOP:
                self._print(f"{self.tag} {crash_loop_message(e)}")
            elif e.get("event") == Event.INTERRUPTED:
                self._print(f"{self.tag} received {e.get('signal')}; stopping all workers")

    def _maybe_show_tail(self, e: dict) -> None:
        """A worker that exited with an error code (not a signal, not on purpose): its last lines."""
        code, p, life = e.get("code"), e.get("process"), int(e.get("incarnation", 0))
        # the life is over: its lines are no longer kept
        tail = list(self._tails.pop((p, life), ())) if p is not None else []
        if code in (None, 0) or e.get("reason") in EXPECTED_EXIT_REASONS or not isinstance(p, int):
            return
        where = self.log_path(p, life)
        before = self._shown.get(p)
        if before is not None and tail and before[1] == tail:  # a crash repeated: once is enough
            self._print(f"{self.tag} process {p} exited with code {code}; the same last lines as incarnation "
                        f"{before[0]} ({where})")
            return
        self._shown[p] = (life, tail)
        self._print(f"{self.tag} process {p} exited with code {code}; its last lines ({where}):")
        for line in tail:
            self._print(f"    | {line}")

    def close(self, exit_code: int, wall_s: float, restarts: dict[int, int]) -> None:
        """Stop the progress line and print the summary (mode ``progress``)."""
        if not self.progress:
            return
        self.restore_stderr()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._drain()
        if self._live is not None:
            self._live.stop()
            self._live = None
        for story in self.tracker.finish():
            self._print(f"{self.tag} incident: {story}")
        t = self.tracker
        if t.commit_times:
            self._print(f"{self.tag} {t.line(time.time())}")
        shas = set(t.finals.values())
        if t.finals:
            agree = f"identical params (sha256 {next(iter(shas))[:12]})" if len(shas) == 1 else \
                f"DIFFERENT params ({len(shas)} distinct sha256)"
            n = len(t.finals)
            self._print(f"{self.tag} {n} process{'es' if n != 1 else ''} finished at step {t.step} with {agree}")
        n = t.incidents_seen
        self._print(f"{self.tag} done in {wall_s:.1f} s, exit code {exit_code}; {n} incident{'s' if n != 1 else ''}; "
                    "restarts " + ", ".join(f"p{p}={n}" for p, n in sorted(restarts.items())))
        if self._launcher_log is not None:
            self._launcher_log.close()
            self._launcher_log = None

    def restore_stderr(self) -> None:
        if self._saved_stderr is not None:
            sys.stderr.flush()
            os.dup2(self._saved_stderr, 2)
            os.close(self._saved_stderr)
            self._saved_stderr = None

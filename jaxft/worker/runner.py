"""Run each step's program in a worker thread, so a member left inside a doomed program can
walk away from it instead of leaving the run.

When a member dies inside a step, the survivors' collectives usually fail within
milliseconds (:mod:`jaxft.worker.breaker`), but gloo (as bundled with jaxlib) can leave one survivor
in a send it had queued on a connection that failed meanwhile, pending until the collective
timeout (``Timeouts.collective``; see :mod:`jaxft.worker.hang`). Nothing outside gloo can wake that
wait. Before, such a member exited (``EXIT_HUNG``), was restarted and rejoined: one more
restart per kill inside a step, and at small widths the run fell to one member.

XLA:CPU runs two programs of one process at once when they are called from two threads: a
program called while another one is blocked completes at once (measured: docs/benchmarks.md,
'Figures behind the code'). So the step's program is called and awaited in a worker thread; the
main thread waits for either its result or :meth:`StepRunner.abandon` (sent by the hang monitor
once the step is doomed and the bound ``Timeouts.stuck`` passed while others wait). On abandon
the main thread raises :class:`Abandoned`, the step fails like any step a member died in, and
the retry runs on a fresh worker thread and a fresh gloo communicator (a new device list),
while the abandoned program finishes in the background when gloo's timeout fires (its result is
dropped). A backend rebuild first waits for abandoned programs (:meth:`StepRunner.drain`),
since the backend must not be torn down under a running program.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class Abandoned(Exception):
    """This process left a step's program running: the step is doomed (a member died in it)."""


class _Worker:
    """One daemon thread running one job at a time until it is abandoned.

    The hand-offs are two plain locks, a few times cheaper than a ``queue.Queue`` each way
    (measured: docs/benchmarks.md, 'Figures behind the code'). ``state`` goes from
    ``"running"`` to ``"done"`` (the worker) or ``"abandoned"`` (:meth:`StepRunner.abandon`),
    whichever comes first, under the runner's lock; that one releases ``done``."""

    def __init__(self, name: str, lock: threading.Lock) -> None:
        self._lock = lock
        self.go = threading.Lock()
        self.go.acquire()
        self.done = threading.Lock()
        self.done.acquire()
        self.job: Callable[[], Any] | None = None
        self.state = "idle"
        self.result: tuple[str, Any] = ("done", None)
        self.why = ""
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.go.acquire()
            job = self.job
            if job is None:  # left, and its wait done, before this thread took it up: nothing to run
                return
            try:
                result = ("done", job())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result = ("error", e)
            with self._lock:
                if self.state != "running":  # abandoned: nobody waits for this result
                    if result[0] == "error":
                        logger.debug("an abandoned step program ended: %s", str(result[1]).splitlines()[0][:200])
                    return
                self.state, self.result = "done", result
            self.done.release()


class StepRunner:
    """Calls step programs in a worker thread; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._abandoned: list[_Worker] = []
        self._count = 0
        self.abandoned_total = 0

    def run(self, job: Callable[[], Any]) -> Any:
        """``job()`` in the worker thread: its result, or its exception re-raised, or
        :class:`Abandoned` if :meth:`abandon` is called meanwhile."""
        return self.wait(self.start(job))

    def start(self, job: Callable[[], Any]) -> _Worker:
        """Start ``job()`` in the worker thread and return at once; :meth:`wait` for it with
        what this returns. One call at a time: each call needs its wait (the runner hands a
        result once) before the next starts, unless it was abandoned."""
        with self._lock:
            if self._worker is None:
                self._count += 1
                self._worker = _Worker(f"jaxft-step-{self._count}", self._lock)
            w = self._worker
            if w.state == "running" or w.job is not None:
                raise RuntimeError("a step program is already running in this runner")
            w.job, w.state = job, "running"
        w.go.release()
        return w

    def wait(self, w: _Worker) -> Any:
        """The result of the call :meth:`start` returned ``w`` for (see :meth:`run`)."""
        w.done.acquire()
        with self._lock:
            state, (kind, value) = w.state, w.result
            w.job, w.result = None, ("done", None)  # (holds no program output or error past its step)
        if state == "abandoned":
            raise Abandoned(w.why)
        if kind == "done":
            return value
        raise value

    def abandon(self, why: str) -> bool:
        """Leave the call in progress (from another thread); False if there is none."""
        with self._lock:
            w = self._worker
            if w is None or w.state != "running":
                return False
            w.state, w.why = "abandoned", why
            self._abandoned.append(w)
            self._worker = None
            self.abandoned_total += 1
        w.done.release()
        return True

    def left(self) -> bool:
        """Whether the calling thread runs a call that was abandoned (a job checks this before
        it starts the program, so a job left before its program began never runs it)."""
        me = threading.current_thread()
        with self._lock:
            return any(w.thread is me for w in self._abandoned)

    def pending(self) -> bool:
        """Whether a program this runner left is still running."""
        with self._lock:
            return self._prune()

    def _prune(self) -> bool:
        """Forget left programs that ended (lock held); True while any still runs."""
        self._abandoned = [w for w in self._abandoned if w.thread.is_alive()]
        return bool(self._abandoned)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for abandoned programs to end; True when none is left."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            workers = list(self._abandoned)
        for w in workers:
            w.thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            return not self._prune()

"""Bounds on the group's barrier waits: no liveness query waits forever.

``live_devices`` and ``get_live_nodes`` have no timeout of their own. :class:`Watchdog` is
one daemon thread per :class:`~jaxft.ElasticGroup` that watches the wait in progress: if
the peers finished the run meanwhile this process exits 0; if the wait outlasts
``Timeouts.barrier`` it exits :data:`~jaxft.protocol.EXIT_BARRIER_TIMEOUT` (a thread cannot
unwind the main thread's wait, so both are hard exits). A wait longer than
``WAIT_NOTICE_S`` is published, so that a member stuck in its step sees it
(:mod:`jaxft.worker.hang`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

from jaxft.protocol import EXIT_BARRIER_TIMEOUT
from jaxft.timeouts import Timeouts
from jaxft.worker.hang import WAIT_NOTICE_S, HangMonitor

logger = logging.getLogger(__name__)


class Watchdog:
    """Arms a bound around one barrier wait at a time (arming costs a lock, not a thread).

    Args:
      process_id: this process (for the messages).
      timeouts: ``barrier`` bounds each wait.
      hang: the step monitor the waits are published to.
      run_finished: whether the peers finished the run (polled while a wait lasts).
      poll_s: how often the thread looks.
    """

    def __init__(self, process_id: int, timeouts: Timeouts, hang: HangMonitor, run_finished: Callable[[], bool],
                 poll_s: float = 0.5):
        self.process_id, self.timeouts, self.hang, self.poll_s = process_id, timeouts, hang, poll_s
        self._run_finished = run_finished
        self._cond = threading.Condition()
        self._armed: tuple[str, float] | None = None
        self._published = False  # this wait was published (jaxft.worker.hang) and must be cleared
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, what: str, publish: bool = False, notice: bool = True) -> Iterator[None]:
        """Bound the wait inside; ``publish``: say at once that this process waits (the exit of a
        failed step: a member stuck in it leaves once it sees that), not only after
        ``WAIT_NOTICE_S``; ``notice`` False: never say it (a hot spare waits for a death, not for
        a member: a member past its step deadline must not take it for one that waits on it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="jaxft-watchdog")
            self._thread.start()
        self.hang.phase("at a barrier")
        if publish:
            self.hang.waiting(what)
        with self._cond:
            self._armed = (what, time.monotonic())
            self._published = publish or not notice  # (not notice: taken for published, never written)
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._armed = None
                published, self._published = self._published and notice, False
            if published:
                self.hang.done_waiting()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._armed is None:
                    self._cond.wait()
                armed = self._armed
                self._cond.wait(self.poll_s)
                if self._armed is not armed:
                    continue  # disarmed (or re-armed) in time
            what, t0 = armed
            if not self._published and time.monotonic() - t0 > WAIT_NOTICE_S:
                self.hang.waiting(what)  # a member may be hung: let it know we wait for it
                with self._cond:
                    self._published = self._armed is armed
                    if not self._published:
                        self.hang.done_waiting()
            if self._run_finished():
                hard_exit(0, f"jaxft: peers finished the run while process {self.process_id} was {what}; exiting 0")
            bound = self.timeouts.barrier
            if time.monotonic() - t0 > bound:
                hard_exit(EXIT_BARRIER_TIMEOUT,
                          f"jaxft: process {self.process_id} waited {bound:.0f} s while {what} "
                          f"(a peer is alive but stuck?), the bound {self.timeouts.describe('barrier')}; exiting")


def hard_exit(code: int, message: str) -> None:
    """Log ``message`` and leave now (a thread cannot unwind the main thread's barrier wait)."""
    (logger.info if code == 0 else logger.error)(message)
    for handler in [*logging.getLogger().handlers, *logger.handlers, logging.lastResort]:
        if handler is not None:
            handler.flush()
    os._exit(code)

"""Hung-but-alive workers: a step deadline, enforced by the hung process on itself.

A worker that is alive but stuck (a deadlock, a stuck read, a host callback that never
returns) keeps its heartbeats going, so the coordination service never declares it dead
and every other member waits for it at the next barrier. jaxft bounds that wait:

* A member that has waited at a step barrier for more than :data:`WAIT_NOTICE_S`
  publishes it (one key-value write per long wait, none in steady state).
* Each process tracks what its main thread is doing (set-up, inside a step, between
  steps) and since when. When that has lasted longer than its deadline *and* another
  member is waiting for it, it is hung: a thread of its own dumps every thread's Python
  stack (``faulthandler``) into its log, logs a ``hung`` event, and ends the process with
  :data:`EXIT_HUNG`. Its launcher restarts it by policy; the others see it gone and go on
  without it, then it rejoins.
* The deadline is ``max(Timeouts.step, STEP_FACTOR x the recent median step time,
  Timeouts.collective + Timeouts.heartbeat + 1 s)`` (the last: a member in a collective with
  a dead peer waits that long by design); the
  set-up before the first step, a step that compiles for a new mesh and a step that
  rehydrates use ``Timeouts.setup`` instead, so a long first compile or a checkpoint
  restore is never taken for a hang. :meth:`HangMonitor.busy` exempts legitimately long
  work between steps (an evaluation only process 0 runs, say).

A step whose member the launcher recorded dead (:meth:`HangMonitor.doomed`, called by the
step's tripwire, see :mod:`jaxft.worker.deaths`) fails anyway, and its collectives usually fail
within milliseconds once the data plane is broken (:mod:`jaxft.worker.breaker`). Not always:
gloo (as bundled with jaxlib) leaves a send it had queued on a connection that failed meanwhile
pending until the collective timeout (``Timeouts.collective``; seen in the issue-13 schedule:
``Timed out waiting 5000ms for send operation to complete``, every other survivor waiting for
it; measured: docs/benchmarks.md, 'Figures behind the code'). Nothing can wake that wait from
outside, so such a member leaves instead: still inside the doomed step
``max(Timeouts.stuck, 2 x the recent median step)`` after the death, while another member
waits for it, it leaves the step's program running in its worker thread and fails the step
like the others
(:mod:`jaxft.worker.runner`; the ``abandoned`` event); if its main thread is not waiting for a
program (stuck elsewhere) or has not left the step :data:`ABANDON_GRACE_S` later, it exits
:data:`EXIT_HUNG` like a hung process and rejoins after its restart. A long step (one that
admits a joiner or compiles) is left the same way from its program, but never ended by that
exit: its main thread may be compiling (seen: a joiner killed in its admission step held every
survivor until the 5 s collective timeout). If every member is stuck, nobody waits and nobody
leaves (the collective timeout ends it).

A process stuck in native code that holds the GIL cannot run this thread; the others'
barrier watchdog (``Timeouts.barrier``) remains the bound there.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator

from jaxft.protocol import EXIT_HUNG
from jaxft.timeouts import Timeouts
from jaxft.worker import kv

logger = logging.getLogger(__name__)

WAIT_NOTICE_S = 1.0  # a barrier wait longer than this is published
STEP_FACTOR = 20.0  # the deadline's multiple of the recent median step
DOOMED_STEP_FACTOR = 2.0  # a doomed step may last this many median steps before its member leaves
DOOMED_POLL_S = 0.02
WAITING_PREFIX = "jaxft/waiting/"
ABANDON_GRACE_S = 1.0  # a member told to leave a doomed step's program exits if still in the step then


class HangMonitor:
    """Tracks this process's phase; ends the process when it is hung (see the module docstring).

    Args:
      process_id: this process.
      timeouts: ``step`` (floor of the deadline) and ``setup`` (set-up, compiles, rejoins).
      on_hung: called with a description before the process exits (logs the ``hung`` event).
      poll_s: how often the monitor thread looks.
    """

    def __init__(self, process_id: int, timeouts: Timeouts, on_hung: Callable[[dict], object] | None = None,
                 poll_s: float = 0.5):
        self.process_id = process_id
        self.timeouts = timeouts
        self.on_hung = on_hung
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._phase, self._since, self._long = "setting up", time.monotonic(), True
        self._step_times: list[float] = []  # start-to-start seconds of recent steps, not long ones
        self._last_start: float | None = None
        self._step_long = False  # the step in progress compiles or rehydrates
        self._busy = 0
        self._finished = False
        self._doomed: tuple[float, float, str] | None = None  # (step's _since, when, why)
        # leave a doomed step's program running instead of exiting (jaxft.worker.runner): returns
        # whether the main thread was waiting for a program it can leave
        self.abandon: Callable[[dict], bool] | None = None
        self._abandoned_at: float | None = None  # when the doomed step in progress was left
        self._wake = threading.Event()
        self._waiting_key: str | None = None
        threading.Thread(target=self._run, name="jaxft-hang-monitor", daemon=True).start()

    # -- what the main thread is doing ----------------------------------------------------
    def phase(self, what: str, long: bool = False) -> None:
        """The main thread now does ``what``; ``long``: bounded by ``Timeouts.setup``."""
        with self._lock:
            self._phase, self._since, self._long = what, time.monotonic(), long

    def step_started(self) -> None:
        """A step's body begins (its start times give the median step time)."""
        now = time.monotonic()
        with self._lock:
            if self._last_start is not None and not self._step_long:  # a compile is no step time
                self._step_times = (self._step_times + [now - self._last_start])[-20:]
            self._last_start, self._step_long = now, False
            self._phase, self._since, self._long = "in a step", now, self._long and self._phase == "in a step"

    def doomed(self, why: str) -> None:
        """The step in progress will fail (``why``: a member's death was recorded during it): if
        the main thread is still in it after :meth:`doomed_deadline` while others wait, leave."""
        with self._lock:
            if self._phase != "in a step":
                return
            self._doomed = (self._since, time.monotonic(), why)
        self._wake.set()

    def doomed_deadline(self) -> float:
        """``max(Timeouts.stuck, DOOMED_STEP_FACTOR x the recent median step)``."""
        with self._lock:
            times = list(self._step_times)
        median = statistics.median(times) if len(times) >= 2 else 0.0
        return max(self.timeouts.stuck, DOOMED_STEP_FACTOR * median)

    def long_step(self) -> None:
        """This step compiles or rehydrates: bound it by ``Timeouts.setup`` (and keep its
        length out of the median step time)."""
        with self._lock:
            self._long = self._step_long = True

    def watch(self, on_hung: Callable[[dict], object], abandon: Callable[[dict], bool]) -> None:
        """A run begins: ``on_hung(info)`` is told when this process is found hung, and
        ``abandon(info)`` may leave a doomed step's program (True: it did)."""
        self.finished(False)
        self.on_hung, self.abandon = on_hung, abandon

    def finished(self, value: bool = True) -> None:
        """The run is over (nobody will wait for this process any more), or a new one starts."""
        with self._lock:
            self._finished = value

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Exempt legitimately long work between steps from the deadline."""
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1

    def deadline(self) -> float:
        with self._lock:
            times, long = list(self._step_times), self._long
        if long or len(times) < 2:
            return self.timeouts.setup
        median = statistics.median(times)
        # A member inside a collective with a dead peer legitimately waits until the collective
        # fails (Timeouts.collective) and the service declares the peer dead (heartbeat).
        patience = self.timeouts.collective + self.timeouts.heartbeat + 1.0
        return max(self.timeouts.step, STEP_FACTOR * median, patience)

    # -- waiting at a barrier -----------------------------------------------------------------
    def waiting(self, what: str) -> None:
        """Publish that this process has been waiting at a barrier for a while."""
        key = f"{WAITING_PREFIX}{self.process_id}"
        try:
            kv.client().key_value_set(key, what, allow_overwrite=True)
            self._waiting_key = key
        except Exception as e:  # noqa: BLE001 - best effort: the others keep their own bounds
            logger.debug("cannot publish the wait: %s", e)

    def done_waiting(self) -> None:
        if self._waiting_key is not None:
            key, self._waiting_key = self._waiting_key, None
            try:
                kv.client().key_value_delete(key)
            except Exception as e:  # noqa: BLE001
                logger.debug("cannot clear the wait: %s", e)

    def _others_waiting(self) -> list[str]:
        entries = kv.try_dir_get(WAITING_PREFIX)  # (none: NOT_FOUND, or an unreachable service)
        mine = f"{WAITING_PREFIX}{self.process_id}"
        return [f"process {k.rsplit('/', 1)[-1]} ({v})" for k, v in entries if k.rstrip("/") != mine]

    # -- the monitor thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                doomed = self._doomed
                if doomed is not None and (self._since != doomed[0] or self._phase != "in a step"):
                    self._doomed = doomed = None  # the doomed step ended: its member left it in time
                    self._abandoned_at = None
            if self._wake.wait(DOOMED_POLL_S if doomed is not None else self.poll_s):
                self._wake.clear()
            with self._lock:
                phase, since, busy, finished, long = self._phase, self._since, self._busy, self._finished, self._long
                doomed = self._doomed
            if busy or finished or phase == "at a barrier":
                continue
            if doomed is not None and doomed[0] == since:
                stuck = time.monotonic() - doomed[1]
                deadline = self.doomed_deadline()
                if stuck > deadline:
                    waiters = self._others_waiting()
                    if waiters and self._abandoned_at is None and self.abandon is not None:
                        info = {"phase": f"{phase} whose {doomed[2]}", "stuck_s": round(stuck, 2),
                                "deadline_s": round(deadline, 2), "waiting": waiters[:8]}
                        if self.abandon(info):  # the main thread leaves the program; it should be
                            self._abandoned_at = time.monotonic()  # out of the step at once
                            continue
                    # A long step (an admission, a compile) is left only from its program: its
                    # main thread may be compiling, which is not a hang; Timeouts.setup bounds it.
                    if not long and waiters and (self._abandoned_at is None
                                                 or time.monotonic() - self._abandoned_at > ABANDON_GRACE_S):
                        self._die(f"{phase} whose {doomed[2]}", stuck, deadline, waiters, setting="stuck")
                if not long:
                    continue
            elapsed = time.monotonic() - since
            deadline = self.deadline()
            if elapsed <= deadline:
                continue
            waiters = self._others_waiting()
            if waiters:
                self._die(phase, elapsed, deadline, waiters)

    def _die(self, phase: str, elapsed: float, deadline: float, waiters: list[str],
             setting: str = "step/Timeouts.setup") -> None:
        info = {"phase": phase, "stuck_s": round(elapsed, 2), "deadline_s": round(deadline, 2),
                "waiting": waiters[:8]}
        message = (f"jaxft: process {self.process_id} is hung: {phase} for {elapsed:.1f} s (deadline "
                   f"{deadline:.1f} s, Timeouts.{setting}) while {', '.join(waiters[:4])} wait for it; "
                   "its Python stacks follow, then it exits so that the others go on")
        logger.error(message)
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            if self.on_hung is not None:
                self.on_hung(info)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_HUNG)

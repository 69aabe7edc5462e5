"""A restarted worker sets up at a low CPU priority, and takes its normal one back when it joins.

Both sides of it live here (it is part of the launcher-worker contract, with
:data:`jaxft.protocol.BASE_NICE`): the launcher lowers, the worker restores.

While a restarted process imports, connects and builds its model, the survivors train on
without it (ready admission); on a machine whose cores the workers share, its set-up used
to slow their steps for as long as it took (measured: docs/benchmarks.md, 'Figures behind
the code'). The launcher starts a *restarted* worker niced (:func:`lowered_nice`); the
worker restores the launcher's priority for every one of its threads as it joins the step
(:func:`restore`), so it never trains niced. Off by default (`jaxft launch --nice-restarts N`):
with it, the test suite ran slower and one connect-admission test failed once, a restarted
process 0 starved by busy members until the 20-step run had ended without it.

Lowering is only done where it can be undone: the launcher runs as root, or
``RLIMIT_NICE`` lets an unprivileged process go back to the launcher's nice value (Linux;
nowhere else). A worker that still fails to restore logs a warning and goes on.
"""

from __future__ import annotations

import logging
import os

from jaxft.protocol import BASE_NICE

logger = logging.getLogger(__name__)

SETUP_NICE = 10  # how much nicer a restarted worker sets up with `jaxft launch --nice-restarts` 10


def _can_restore(base: int) -> bool:
    if not hasattr(os, "setpriority"):
        return False
    if os.geteuid() == 0:
        return True
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    except (ImportError, AttributeError, OSError, ValueError):
        return False
    return soft == resource.RLIM_INFINITY or 20 - soft <= base  # the lowest nice allowed is 20 - soft


def lowered_nice(amount: int = SETUP_NICE) -> int | None:
    """Launcher side: the nice value to start a restarted worker with (``amount`` nicer than
    the launcher), or None (``amount`` 0, or not undoable here)."""
    if amount <= 0:
        return None
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        return None
    if base >= 19 or not _can_restore(base):
        return None
    return min(19, base + amount)


def start_niced(nice: int) -> None:
    """In the child before exec (``preexec_fn``): set this process's nice value."""
    os.setpriority(os.PRIO_PROCESS, 0, nice)


def restore() -> bool:
    """Worker side, as it joins: give every thread of this process the launcher's nice value
    back (Linux nice values are per thread). True if anything was restored."""
    base = os.environ.pop(BASE_NICE, None)
    if base is None:
        return False
    target = int(base)
    failed, total = set_all_threads(target)
    if failed:
        logger.warning("could not restore the CPU priority of %d of %d threads (nice %d): this worker "
                       "trains niced", failed, total, target)
    return True


def set_all_threads(nice: int) -> tuple[int, int]:
    """Give every thread of this process the nice value ``nice`` (Linux nice values are per
    thread): ``(threads it could not set, threads)``."""
    tids = [0]
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        pass
    failed = 0
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            failed += 1
    return failed, len(tids)

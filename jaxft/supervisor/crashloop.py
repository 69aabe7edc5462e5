"""A worker that fails the same way before its first commit, life after life, is not restarted on.

A restart helps a worker that died of a fault; one that crashes during its set-up (an
import error, a bad path, a shape bug that shows up at its first step) crashes again after
every restart, each time after a full set-up, until ``--max-restarts`` runs out. The
launcher tells the two apart by what each life reached: the worker marks its first committed
step (:func:`mark_committed`, called by :class:`jaxft.ElasticGroup`; a file
``<state dir>/committed/<process>-<incarnation>`` in the directory the launcher shares with
its workers), and :class:`SetupFailures` counts, per process, the lives in a row that
*crashed* before any commit with the same exit status. At ``limit`` the launcher stops
restarting that process and says why.

What counts as a crash is narrow on purpose, so a fault is never mistaken for a bug: an exit
code other than 0, :data:`~jaxft.protocol.EXIT_BARRIER_TIMEOUT` (the peers held it up) and
:data:`~jaxft.protocol.EXIT_HUNG`, or a crash signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL).
SIGKILL and SIGTERM (a fault, the OOM killer, a scheduler) never count, nor does a life that
committed a step: it ran, so its death is a fault of the run, not of its set-up. A worker
that never uses an :class:`~jaxft.ElasticGroup` never commits in this sense, so any command
that crashes ``limit`` times in a row the same way is stopped too.
"""

from __future__ import annotations

import signal

from jaxft import protocol

DEFAULT_LIMIT = 3  # `jaxft launch --max-setup-crashes`
# exit codes of a worker that gave up on its peers, not of a broken set-up
_NOT_CRASHES = (protocol.EXIT_BARRIER_TIMEOUT, protocol.EXIT_HUNG)
_CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL})


def committed(state_dir: str, process_id: int, incarnation: int) -> bool:
    """Whether ``process_id``'s launcher incarnation ``incarnation`` committed a step (the
    worker's :data:`jaxft.protocol.COMMITTED` mark)."""
    return protocol.life_marked(state_dir, protocol.COMMITTED, process_id, incarnation)


def is_crash(returncode: int) -> bool:
    """Whether an exit status is a crash of the worker's own (see the module docstring)."""
    if returncode < 0:
        return -returncode in _CRASH_SIGNALS
    return returncode != 0 and returncode not in _NOT_CRASHES


class SetupFailures:
    """Per process, the lives in a row that crashed before their first commit with one exit status."""

    def __init__(self, state_dir: str, limit: int = DEFAULT_LIMIT) -> None:
        self.state_dir, self.limit = state_dir, limit
        self._runs: dict[int, tuple[int, int]] = {}  # process -> (exit status, lives in a row)

    def record(self, process_id: int, incarnation: int, returncode: int) -> int:
        """Count one ended life; returns how many lives in a row of ``process_id`` crashed
        before a commit with this exit status (0 when this one does not count)."""
        if not is_crash(returncode) or committed(self.state_dir, process_id, incarnation):
            self._runs.pop(process_id, None)
            return 0
        code, n = self._runs.get(process_id, (returncode, 0))
        n = n + 1 if code == returncode else 1
        self._runs[process_id] = (returncode, n)
        return n

    def tripped(self, process_id: int) -> bool:
        """Whether ``process_id`` reached ``limit`` (0: the guard is off)."""
        return self.limit > 0 and self._runs.get(process_id, (0, 0))[1] >= self.limit

"""Quiet the dead connections gloo's event loop reports ready for ever.

When a member dies, every survivor's gloo communicators for the member sets it was in keep a
connection to it, now closed. A survivor that keeps its CPU backend after the failure (a spare
swapped in, a narrower retry: :mod:`jaxft.worker.dataplane`) keeps those communicators, and
gloo's event loop sometimes never closes such a connection: epoll reports it ready
(``EPOLLIN | EPOLLHUP``, level-triggered) on every call, its handler returns without reading
it, and the loop's thread spins a whole core until the backend goes (issue 40's schedule with
a spare: one or two survivors after most deaths, for the rest of the run; on two cores, half the
machine; measured: docs/benchmarks.md, session 36).

So after a failed step, :meth:`DeadPairs.after_commit` looks at the registrations of gloo's
epoll instance (the one that watches gloo's listener, :func:`jaxft.worker.breaker.gloo_listeners`)
at each commit: a connection it finds closed at two commits in a row is not one of the current
members' (a commit went through after it closed, with every member alive), and is disarmed
(:func:`jaxft._compat.disarm`): epoll stops reporting it, and gloo can still remove it when it
destroys the communicator. A rebuild starts the looks too, and a replaced backend still alive
is looked at with the current one (its connections die as the peers free their old backends).
The looks stop at a commit that finds none while no replaced backend lives, or after
:data:`MAX_LOOKS`; each is a few milliseconds of ``/proc`` reads and system calls (the first of
a backend also reads gloo's records from the service), only after failures and rebuilds.
"""

from __future__ import annotations

import logging

from jaxft import _compat
from jaxft.worker import breaker

logger = logging.getLogger(__name__)

MAX_LOOKS = 8  # commits after a failure that look at most


def _key(r: _compat.Registration) -> tuple[int, int, int, int]:
    return r.epoll, r.fd, r.data, r.inode  # (not the events: gloo may add EPOLLOUT)


class DeadPairs:
    """One process's looks for dead connections gloo's loops keep reporting (see the module docstring)."""

    def __init__(self, process_id: int) -> None:
        self.process_id = process_id
        self._looks = 0  # commits left that look
        self._seen: set[tuple[int, int, int, int]] = set()  # closed at the last look
        self._gloo: tuple[int, int] | None = None  # (gloo's epoll descriptor, its listener's inode), as last found
        self._replaced: list[tuple[int, int]] = []  # the same of backends a rebuild replaced (while they live)
        self.disarmed = 0  # in this process's life

    def step_failed(self) -> None:
        """A step failed: look at the next commits."""
        self._looks = MAX_LOOKS

    def backend_replaced(self) -> None:
        """A rebuild replaced the backend: its loop lives on until the backend is freed (a
        backend held from C++ never is), and its connections die as the peers free theirs;
        keep looking at it too, from the next commits."""
        if self._gloo is not None:
            self._replaced.append(self._gloo)
            self._gloo = None
        self._looks = MAX_LOOKS

    def after_commit(self) -> int:
        """After a commit, while looking: disarm the connections closed at the last look too;
        returns how many it disarmed."""
        if not self._looks:
            return 0
        self._looks -= 1
        dead = self.dead_registrations()
        quiet = [r for r in dead if _key(r) in self._seen and _compat.disarm(r)]
        self._seen = {_key(r) for r in dead} - {_key(r) for r in quiet}
        if not self._seen and not self._replaced:
            self._looks = 0
        if quiet:
            self.disarmed += len(quiet)
            logger.info("process %d: gloo's event loop kept reporting %d closed connection(s) of earlier member "
                        "sets; disarmed them", self.process_id, len(quiet))
        return len(quiet)

    def dead_registrations(self) -> list[_compat.Registration]:
        """The sockets gloo's epoll instances watch, level-triggered, that are neither connected
        nor listening (one disarmed already is one-shot, so not among them)."""
        mine = breaker.my_sockets()
        table = breaker.tcp_sockets(mine)
        regs = self.gloo_registrations(table, mine)
        live = {i for i, s in table.items() if s.state in (breaker.ESTABLISHED, breaker.LISTEN)}
        return [r for r in regs if r.inode in mine and r.inode not in live  # (a socket: not its pipe)
                and not r.events & (_compat.EPOLLONESHOT | _compat.EPOLLET)]

    def gloo_registrations(self, table: dict, mine: dict[int, int]) -> list[_compat.Registration]:
        """What gloo's epoll instances watch: the current backend's (the one that watches gloo's
        listener, found again, reading gloo's records from the service, only when the backend
        changed) and those of replaced backends still alive."""
        out: list[_compat.Registration] = []
        kept = []
        for epoll, listener in self._replaced:
            regs = _compat.registrations_of(epoll)
            if any(r.inode == listener for r in regs):  # (else freed: its descriptor may be another's now)
                kept.append((epoll, listener))
                out += regs
        self._replaced = kept
        if self._gloo is not None:
            epoll, listener = self._gloo
            regs = _compat.registrations_of(epoll)
            if any(r.inode == listener for r in regs):
                return out + regs
        listeners = breaker.gloo_listeners(table, mine)
        found = [r for r in _compat.epoll_registrations() if r.inode in listeners]
        if not found:
            self._gloo = None
            return out
        self._gloo = (found[0].epoll, found[0].inode)
        return out + _compat.registrations_of(found[0].epoll)

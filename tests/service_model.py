"""A model of the coordination service's liveness queries, for tests of the protocol.

XLA's ``CoordinationService::GetAliveTasksAsync`` (what ``client.get_live_nodes`` calls):
a query is identified by its set of processes alone; a process joins the pending query over
that set by asking (it stays counted in even if it stops waiting: there is no cancel); the
query completes, for every process that asked, once every process of the set that the
service believes alive has asked, and answers with those alive processes and their
incarnations. A process is alive for the service until its heartbeat times out
(:meth:`ServiceModel.heartbeat_timeout`), and a new registration of it replaces its
incarnation at once (:meth:`ServiceModel.new_life`, what a restart's connect does, and what
``jaxft._compat.retire_life`` does for a process the launcher saw die).

Every completed query records the label each asker gave it (which of its own queries it
was), so a test can check that the members stayed in step: the askers of one query instance
must all be at the same point of their own sequences.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Hashable, Iterable


@dataclasses.dataclass
class _Pending:
    tasks: frozenset[int]
    asked: dict[int, Hashable] = dataclasses.field(default_factory=dict)  # task -> label
    waiters: list = dataclasses.field(default_factory=list)  # done(answer) callbacks


class ServiceModel:
    """The liveness queries of one coordination service with ``n`` processes (ids 0..n-1)."""

    def __init__(self, n: int, wait_s: float = 10.0):
        self._lock = threading.RLock()  # (a done callback may ask again)
        self.incarnation = {p: 1000 + p for p in range(n)}
        self._lives = 1000 + n  # the last incarnation handed out
        self.alive = set(range(n))
        self.pending: list[_Pending] = []
        self.completed: list[tuple[frozenset[int], dict[int, Hashable], dict[int, int]]] = []
        self.wait_s = wait_s

    def ask(self, task: int, pids: Iterable[int], label: Hashable = None) -> dict[int, int]:
        """``get_live_nodes(pids)`` by ``task`` (blocking, bounded by ``wait_s``)."""
        event, box = threading.Event(), {}

        def done(answer: dict[int, int]) -> None:
            box["answer"] = answer
            event.set()

        self.submit(task, pids, done, label)
        if not event.wait(self.wait_s):
            raise TimeoutError(f"process {task}'s query over {sorted(pids)} never completed")
        return dict(box["answer"])

    def submit(self, task: int, pids: Iterable[int], done: Callable[[dict[int, int]], None],
               label: Hashable = None) -> None:
        """``get_live_nodes(pids)`` by ``task`` without blocking: ``done(answer)`` is called when
        the query completes (at once, if this ask completes it)."""
        with self._lock:
            key = frozenset(pids)
            state = next((s for s in self.pending if s.tasks == key), None)
            if state is None:
                state = _Pending(key)
                self.pending.append(state)
            state.asked[task] = label
            state.waiters.append(done)
            self._refresh()

    def waiting(self, task: int, pids: Iterable[int]) -> bool:
        """Whether ``task`` is counted in the pending query over ``pids``."""
        with self._lock:
            return any(s.tasks == frozenset(pids) and task in s.asked for s in self.pending)

    def heartbeat_timeout(self, task: int) -> None:
        """The service declares ``task`` dead."""
        with self._lock:
            self.alive.discard(task)
            self._refresh()

    def new_life(self, task: int) -> None:
        """``task`` registers again: a new incarnation (never one seen before), alive."""
        with self._lock:
            self._lives += 1
            self.incarnation[task] = self._lives
            self.alive.add(task)
            self._refresh()

    def _refresh(self) -> None:
        for state in list(self.pending):
            alive = state.tasks & self.alive
            if alive <= set(state.asked):
                answer = {p: self.incarnation[p] for p in alive}
                for done in state.waiters:
                    done(dict(answer))
                self.pending.remove(state)
                self.completed.append((state.tasks, dict(state.asked), answer))

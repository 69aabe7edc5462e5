"""Liveness queries (``get_live_nodes``) run in daemon threads that are kept for the next one.

A query may never return (it waits for a dead process, and the service keeps it open): its
thread must not hold up the interpreter's exit, as a thread pool's would, and the waiter must
be able to leave it (:class:`jaxft.worker.deaths.DeathWatch`)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any


class QueryThread:
    """A daemon thread that runs one query at a time and waits for the next once it returns.

    Starting a thread per query was a sizeable part of each step's exit query (measured:
    docs/benchmarks.md, 'Figures behind the code'); handing a query to a waiting thread costs a
    lock release. A query that never returns (abandoned: it waits for a dead process) keeps its
    thread, which is never handed another one; the next query gets another thread."""

    IDLE_MAX = 2  # threads kept waiting; more are only ever needed while queries are abandoned
    _idle: list[QueryThread] = []
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._go = threading.Lock()
        self._go.acquire()
        self._job: tuple[Callable[[], Any], concurrent.futures.Future] | None = None
        threading.Thread(target=self._run, name="jaxft-live", daemon=True).start()

    @classmethod
    def submit(cls, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with cls._lock:
            worker = cls._idle.pop() if cls._idle else None
        if worker is None:
            worker = cls()
        worker._job = (fn, future)
        worker._go.release()
        return future

    def _run(self) -> None:
        while True:
            self._go.acquire()
            job, self._job = self._job, None
            assert job is not None  # (set before _go is released)
            fn, future = job
            try:
                result, error = fn(), None
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                result, error = None, e
            with QueryThread._lock:  # waiting again before the waiter asks its next query
                keep = len(QueryThread._idle) < self.IDLE_MAX
                if keep:
                    QueryThread._idle.append(self)
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
            del fn, future, result, error  # hold nothing of a finished query
            if not keep:
                return


def ask(query: Callable[[list[int]], Mapping[Any, Any]], pids: Sequence[int]) -> concurrent.futures.Future:
    """Run ``query(pids)`` in a daemon thread (an abandoned one may never return: it must not
    hold up the interpreter's exit, as a thread pool's workers would), reusing a thread
    whose last query returned (:class:`QueryThread`)."""
    pids = list(pids)
    return QueryThread.submit(lambda: query(pids))

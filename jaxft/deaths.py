"""Fast death detection on one node: the launcher records each worker death it sees.

The launcher learns of a local worker's death the moment its process exits; the
coordination service would notice only after ``Timeouts.heartbeat``. :func:`record`
writes ``<state dir>/deaths/<process>-<incarnation>`` (the time of death) into the
directory the launcher already shares with its workers (``JAXFT_FAULT_STATE_DIR``).
:class:`DeathWatch` lets a member waiting in a liveness query (``get_live_nodes``) stop
waiting for a process whose current life is confirmed dead and query again without it;
the abandoned query completes on its own at the heartbeat timeout and is ignored.

Safety: only an exited OS process is recorded (never a guess from timing), so a slow but
alive worker is never left out by this; a record counts only against a life that began
before it (a re-admitted process is not affected by its previous death). Workers on other
nodes, and host deaths, still fall back to the heartbeat.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any, Callable, Mapping, Sequence

from jaxft import envvars

SUBDIR = "deaths"


def record(state_dir: str, process_id: int, incarnation: int) -> None:
    """Record (launcher side) that ``process_id``'s launcher incarnation ``incarnation`` died now."""
    d = os.path.join(state_dir, SUBDIR)
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{process_id}-{incarnation}")
    with open(tmp, "w") as f:
        f.write(f"{time.time():.6f}")
    os.replace(tmp, os.path.join(d, f"{process_id}-{incarnation}"))


def deaths(state_dir: str) -> dict[int, float]:
    """``{process: time of its latest recorded death}``."""
    out: dict[int, float] = {}
    d = os.path.join(state_dir, SUBDIR)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return out
    for name in names:
        if name.startswith("."):
            continue
        try:
            p = int(name.split("-", 1)[0])
            with open(os.path.join(d, name)) as f:
                t = float(f.read())
        except (OSError, ValueError):
            continue
        out[p] = max(out.get(p, 0.0), t)
    return out


class DeathWatch:
    """Liveness queries that stop waiting for processes the launcher saw die."""

    def __init__(self, state_dir: str | None = None, poll_s: float = 0.005):
        self.state_dir = state_dir if state_dir is not None else os.environ.get(envvars.FAULT_STATE_DIR)
        self.poll_s = poll_s
        self.since: dict[int, tuple[int, float]] = {}  # process -> (service incarnation, first seen)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="jaxft-live")

    def assume_alive_since(self, pids: Sequence[int], t: float) -> None:
        """A joiner's first view: ``pids`` were all alive at time ``t`` (when it was admitted)."""
        for p in pids:
            self.since[p] = (None, t)

    def saw(self, live: Mapping[int, int]) -> None:
        """Note when each life in ``live`` (process -> service incarnation) was first seen."""
        now = time.time()
        for p, inc in live.items():
            known = self.since.get(p)
            if known is None or (known[0] is not None and known[0] != inc):
                self.since[p] = (inc, now)
            elif known[0] is None:
                self.since[p] = (inc, known[1])

    def dead(self, pids: Sequence[int]) -> set[int]:
        """Those of ``pids`` whose current life, as this process knows it, was recorded dead
        (a life it knows nothing of never counts: the heartbeat decides then)."""
        if not self.state_dir:
            return set()
        rec = deaths(self.state_dir)
        return {p for p in pids if p in rec and p in self.since and rec[p] > self.since[p][1]}

    def live_nodes(self, query: Callable[[list[int]], Mapping[Any, Any]], pids: Sequence[int]) -> dict[int, int]:
        """``query(pids)`` (a ``get_live_nodes`` barrier), re-asked without any process the
        launcher records dead while waiting. Every member that waits for that process sees
        the same record, so all of them move to the same smaller query."""
        pids = sorted(pids)
        if not self.state_dir:
            return {int(p): int(i) for p, i in query(pids).items()}
        while True:
            future = self._pool.submit(query, list(pids))
            while True:
                try:
                    return {int(p): int(i) for p, i in future.result(timeout=self.poll_s * 4).items()}
                except concurrent.futures.TimeoutError:
                    gone = self.dead(pids)
                    if gone:
                        break
            pids = [p for p in pids if p not in gone]  # the abandoned query ends at the heartbeat timeout

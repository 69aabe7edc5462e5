"""Admission when ready: a joiner sets up without holding up the members.

``live_devices(devices)`` agrees only over the processes hosting ``devices``, so the
members run their steps over their own devices and a restarted (or late) process stays
out of their barriers until it is ready. Then:

1. The joiner writes ``jaxft/ready/<process>/<nonce>`` (:meth:`Joiner.announce`) and waits
   for ``jaxft/admit/<process>/<nonce>`` (:meth:`Joiner.wait_admitted`).
2. Every member runs a :class:`ReadyWatcher`, a daemon thread that lists the ready keys
   off the step's critical path. Each step carries this member's view as a vote
   (:meth:`ReadyWatcher.votes`, one int per process id) through the step's own
   all-reduce (summed), so the union of the votes is part of the committed step: every
   member has the same value, or the step failed everywhere and nobody uses it. No extra
   coordination-service round trip is made on any step. A member that cannot take a
   joiner in yet votes :data:`HOLD` (:func:`held`), which outweighs every ready vote.
3. After committing a step whose agreed votes name a joiner, every member writes the
   joiner's admission key (the same value everywhere: the process ids of the next step's
   barrier) and deletes the ready key it consumed; the next step's ``live_devices`` is
   over the members plus the admitted, and the joiner enters that same barrier.

A joiner that finds no running members (a cold start, or everyone died) enters the
barrier over every device, as all processes do at the start of a run.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from jaxft.core.coldstart import Adopt
from jaxft.core.votes import HOLD, READY
from jaxft.errors import BarrierTimeout
from jaxft.timeouts import Timeouts
from jaxft.worker import kv, lives

logger = logging.getLogger(__name__)

READY_PREFIX = "jaxft/ready/"
ADMIT_PREFIX = "jaxft/admit/"
MEMBERS_KEY = "jaxft/members"
SWAP_PREFIX = "jaxft/swap/"  # after a failed step: the spares its survivors take in (jaxft.core.spares.swap_key)


def publish_members(entry: Mapping[int, int], writer: int) -> None:
    """Record the current members (``entry``: the step's entry answer, process -> life) and the
    writer's heartbeat nonce (each member, when the members change: a joiner takes the run for
    gone only when none of them beats; a cold start's stranded process takes the answer,
    :mod:`jaxft.worker.coldstart`)."""
    value = json.dumps({"pids": sorted(entry), "lives": {str(p): int(i) for p, i in entry.items()},
                        "time": time.time(), "beat": kv.Heartbeat.get().nonce})
    kv.client().key_value_set(f"{MEMBERS_KEY}/{writer}", value, allow_overwrite=True)


def held(votes: np.ndarray, members: Sequence[int]) -> np.ndarray:
    """``votes`` with every non-member's slot set to :data:`HOLD`: this member cannot take a
    joiner in yet (a step program it left still runs on the backend an admission rebuilds;
    waiting for it there holds every member until that program ends: seconds in a chaos run,
    measured: docs/benchmarks.md, 'Figures behind the code'). The members go on at their
    width meanwhile and admit at the first step no member holds."""
    out = np.array(votes, copy=True)
    for p in range(len(out)):
        if p not in members:
            out[p] = HOLD
    return out


def fresh_ready(entries: Sequence[tuple[str, str]], deaths: Mapping[int, float],
                retired: Collection[int] = ()) -> dict[int, str]:
    """``{process: nonce}`` of the ready keys ``entries`` (``jaxft/ready/<process>/<nonce>`` ->
    the time it announced) that no life died after announcing: a key whose process has a death
    recorded since (``deaths``: process -> latest death, this node's) or whose newest life was
    retired by its launcher (``retired``: any node's; a life registers before it announces, so
    every key of such a process is older than its death) was left by a life that died waiting,
    a hot spare most often, and admitting it would hold the members' next entry for a process
    that never comes. The newest announcement of a process wins."""
    best: dict[int, tuple[float, str]] = {}
    for key, value in entries:
        parts = key.rstrip("/").split("/")
        try:
            p, nonce, at = int(parts[-2]), parts[-1], float(value)
        except (ValueError, IndexError):
            continue
        if deaths.get(p, float("-inf")) >= at or p in retired:
            continue
        if p not in best or at > best[p][0]:
            best[p] = (at, nonce)
    return {p: nonce for p, (_, nonce) in best.items()}


class ReadyWatcher:
    """A member's view of the joiners that announced readiness (a daemon thread). ``deaths``:
    the deaths its launcher recorded for this node's processes (process -> latest;
    :meth:`jaxft.worker.deaths.DeathWatch.records`): a ready key left by a life that died since
    is not voted (:func:`fresh_ready`; another node's is known by its retired life record)."""

    def __init__(self, num_processes: int, deaths: Callable[[], Mapping[int, float]] = dict, poll_s: float = 0.2):
        self.num_processes = num_processes
        self.poll_s = poll_s
        self._deaths = deaths
        self._seen: dict[int, str] = {}  # process -> nonce of its ready key
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxft-ready-watcher", daemon=True)
        self._thread.start()
        # Stop before interpreter teardown: a daemon thread inside a gRPC call then aborts the process.
        atexit.register(self.stop)

    def _run(self) -> None:
        c = kv.client()
        while not self._stop.wait(self.poll_s):
            try:
                entries = c.key_value_dir_get(READY_PREFIX)
            except Exception:  # noqa: BLE001 - the service is gone: the job is ending
                return
            retired = {p for p, life in lives.all_current(c).items() if life.retired} if entries else set()
            with self._lock:
                self._seen = fresh_ready(entries, self._deaths() if entries else {}, retired)

    def votes(self, members: Sequence[int]) -> np.ndarray:
        """int32 ``[num_processes]``: :data:`READY` for each non-member with a ready key."""
        v = np.zeros(self.num_processes, np.int32)
        with self._lock:
            for p in self._seen:
                if p not in members and 0 <= p < self.num_processes:
                    v[p] = READY
        return v

    def admit(self, joiners: Sequence[int], barrier_pids: Sequence[int], members: Mapping[int, int]) -> None:
        """Write the admission keys of ``joiners`` (the next step's barrier, when, and the
        admitting ``members``' lives) and consume their ready keys."""
        c = kv.client()
        value = (",".join(str(p) for p in sorted(barrier_pids)) + f";{time.time():.6f};"
                 + json.dumps({str(p): int(i) for p, i in members.items()}))
        with self._lock:
            nonces = {p: self._seen.pop(p, None) for p in joiners}
        for p, nonce in nonces.items():
            if nonce is None:
                continue  # another member's vote; that member writes this joiner's key
            c.key_value_set(f"{ADMIT_PREFIX}{p}/{nonce}", value, allow_overwrite=True)
            c.key_value_delete(f"{READY_PREFIX}{p}/{nonce}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class StillSpare(Exception):
    """A joiner's wait (:meth:`Joiner.wait_admitted`) gave back control, still announced."""


class Joiner:
    """The joiner's side: find out whether a run is going on, announce, wait to be admitted."""

    def __init__(self, process_id: int, timeouts: Timeouts, poll_s: float = 0.25):
        self.process_id = process_id
        self.timeouts = timeouts
        self.poll_s = poll_s
        self.nonce = f"{os.getpid()}-{os.urandom(4).hex()}"

    def running_members(self, settle_s: float) -> list[int] | None:
        """The member list of a running job, or None when no member heartbeats (cold start)."""
        pids, first = self._member_beats()
        if pids is None:
            return None
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now_pids, now = self._member_beats()
            if now_pids != pids:
                return now_pids  # the members moved on: they run
            if any(now[b] != v for b, v in first.items()):
                return pids
        return None

    def listed_members(self) -> list[int] | None:
        """The newest member list the members published, whether or not they still run."""
        return self._member_beats()[0]

    def _member_beats(self, entries: list[tuple[str, str]] | None = None
                      ) -> tuple[list[int] | None, dict[str, str | None]]:
        """The newest member list the members published, and the heartbeat counter of each
        member that published it (any of them beating: the run goes on; only the lowest
        member's was watched before, and a joiner that came up while it died, the others
        stuck in a 60 s save barrier, took the run for gone and started a second copy of it
        from the checkpoint)."""
        if entries is None:
            entries = kv.try_dir_get(f"{MEMBERS_KEY}/")
        records = [json.loads(v) for _, v in entries]
        if not records:
            return None, {}
        pids = max(records, key=lambda r: r["time"])["pids"]
        c = kv.client()
        return list(pids), {r["beat"]: kv.try_get(kv.Heartbeat.key(r["beat"]), c) for r in records if r["pids"] == pids}

    def announce(self) -> None:
        """Say this process is ready (the key's value: when), and drop the keys earlier lives of
        this process left (they died waiting: none of them can be admitted)."""
        c = kv.client()
        stale = [k for k, _ in kv.try_dir_get(f"{READY_PREFIX}{self.process_id}/", c) if k != self._ready_key]
        for key in stale:
            c.key_value_delete(key)
        c.key_value_set(self._ready_key, f"{time.time():.6f}", allow_overwrite=True)

    @property
    def _ready_key(self) -> str:
        return f"{READY_PREFIX}{self.process_id}/{self.nonce}"

    def wait_admitted(self, members_gone_s: float | None = None, width: int | None = None,
                      give_back_s: float | None = None,
                      entered: Callable[[list[tuple[str, str]]], Mapping[int, int] | None] | None = None
                      ) -> tuple[list[int], float, dict[int, int]] | Adopt | None:
        """Block until the members admit this process; returns the barrier's process ids, when
        they were admitting it (all of them alive then) and the admitting members' lives
        (process -> incarnation). None if the members stopped
        meanwhile: no heartbeat of the newest member list's members moved for ``members_gone_s`` (they all
        died; then this process withdraws its announcement and starts cold with the others'
        restarts, rather than wait for an admission that cannot come).

        With spares (``width``: the run's member count), the time the listed members fill the
        width does not count against ``Timeouts.admission``: this process is a spare then.
        ``give_back_s``: raise :class:`StillSpare` after that long, still announced, so that
        the caller may bound its waits one at a time.

        ``entered(entries)``: from the members records' ``(key, value)`` entries (read once a
        poll, with the beats), the members' entry if they entered a step with this life, which they
        never admitted (:func:`jaxft.worker.coldstart.adopted_entry`): a query an earlier ask
        of this life left (a cold start's, given up when it found them running without it)
        stays open in the service with this process counted in, and the asks of the members'
        restarts, starting cold after every member died, complete it. They wait for this
        process inside that step; it withdraws and returns :class:`~jaxft.core.coldstart.Adopt`
        (soak seed 2, session 35: it waited here for them for ever, their beats moving)."""
        c = kv.client()
        key = f"{ADMIT_PREFIX}{self.process_id}/{self.nonce}"
        t0 = started = time.monotonic()
        beats, beats_since = None, time.monotonic()
        while True:
            try:
                return self._admission(c, key, c.blocking_key_value_get(key, int(self.poll_s * 1000)))
            except Exception as e:
                if "DEADLINE" not in str(e) and "timed out" not in str(e).lower():
                    raise
            watching = entered is not None or members_gone_s is not None
            entries = kv.try_dir_get(f"{MEMBERS_KEY}/", c) if watching else []
            if entered is not None and (entry := entered(entries)) is not None:
                value = kv.try_get(key, c)  # (an admission that landed since the wait above wins)
                if value is not None:
                    return self._admission(c, key, value)
                self._withdraw(c)
                logger.warning("process %d: the members entered a step with it as it waited to be admitted, on a "
                               "query it left; entering with them", self.process_id)
                return Adopt(dict(entry))
            if members_gone_s is not None:
                now = self._member_beats(entries)
                if width is not None and now[0] is not None and len(now[0]) >= width:
                    t0 = time.monotonic()  # a spare: the members are at full width
                if now != beats:
                    beats, beats_since = now, time.monotonic()
                elif time.monotonic() - beats_since > members_gone_s:
                    self._withdraw(c)
                    return None
            if give_back_s is not None and time.monotonic() - started > give_back_s:
                raise StillSpare(self.process_id)
            if time.monotonic() - t0 > self.timeouts.admission:
                raise BarrierTimeout(f"process {self.process_id} was not admitted within "
                                     f"{self.timeouts.describe('admission')}")

    @staticmethod
    def _admission(c, key: str, value: str) -> tuple[list[int], float, dict[int, int]]:
        """The admission ``value`` the members wrote at ``key`` (deleted: consumed)."""
        c.key_value_delete(key)
        pids, when, members = (value.split(";", 2) + ["", ""])[:3]
        return ([int(p) for p in pids.split(",") if p], float(when or time.time()),
                {int(p): int(i) for p, i in json.loads(members or "{}").items()})

    def _withdraw(self, c) -> None:
        """Take back this process's announcement (best effort)."""
        try:
            c.key_value_delete(self._ready_key)
        except Exception:  # noqa: BLE001 - best effort
            pass

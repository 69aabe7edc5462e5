"""Fast death detection on one node: the launcher records each worker death it sees.

The launcher learns of a local worker's death the moment its process exits; the
coordination service would notice only after ``Timeouts.heartbeat``. :func:`jaxft.protocol.record_death`
writes ``<state dir>/deaths/<process>-<incarnation>`` (the time of death) into the
directory the launcher already shares with its workers (``JAXFT_FAULT_STATE_DIR``).
:class:`DeathWatch` lets a member waiting in a liveness query (``get_live_nodes``) stop
waiting for a process whose current life is confirmed dead and query again without it;
the abandoned query completes on its own at the heartbeat timeout and is ignored.

:class:`Tripwire` does the same for a member inside a step's body: a process that dies
while the others run the step's collectives is met by gloo only on the pairs that lead to
it, and a member that waits on a live peer that already gave up would wait out the
collective timeout (measured: docs/benchmarks.md, 'Figures behind the code'). The
tripwire calls its action (the breaker) the moment a member's death is recorded, whatever
pair this process waits on.

Safety: only an exited OS process is recorded (never a guess from timing), so a slow but
alive worker is never left out by this; a record counts only against a life that began
before it (a re-admitted process is not affected by its previous death). A worker on another
node is known dead once its launcher retired its life and wrote so in its life record
(:func:`jaxft.supervisor.retire.record_retired`), read by a query that waited
:attr:`DeathWatch.LIVES_CHECK_S`; host deaths still fall back to the heartbeat.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from jaxft import protocol
from jaxft.core import liveness
from jaxft.worker import dirwatch
from jaxft.worker import lives as lives_lib
from jaxft.worker.asking import ask as _ask

_ASKED = "asked"  # key of the set last asked in an answer of DeathWatch._ask_once


class GaveUp(Exception):
    """A liveness query was abandoned because its caller's ``give_up()`` said so."""


class DeathWatch:
    """Liveness queries that stop waiting for processes the launcher saw die."""

    # A query waiting this long reads the lives' records (one read of every process's), then
    # again after twice as long each time, up to LIVES_CHECK_MAX_S: a death is seen within the
    # first reads, and a long wait for a slow member costs the service few reads.
    LIVES_CHECK_S = 0.2
    LIVES_CHECK_MAX_S = 1.0

    def __init__(self, state_dir: str | None = None, poll_s: float = 0.005):
        self.state_dir = state_dir if state_dir is not None else os.environ.get(protocol.FAULT_STATE_DIR)
        self.poll_s = poll_s
        self.since: dict[int, tuple[int | None, float]] = {}  # process -> (incarnation (None: any), first seen)
        # Queries left waiting for a dead process, by process set: the service keeps each one
        # open (this process counted in) until every live process of the set has asked; with
        # whether it was left on adopting the others' entry (:meth:`adopted`).
        self._abandoned: dict[tuple[int, ...], tuple[concurrent.futures.Future, bool]] = {}
        self.asking: tuple[int, ...] = ()  # the set of the query asked last
        self.noticed: dict[int, str] = {}  # process -> how a query of this process learnt its life was over
        self._lock = threading.Lock()  # dead() is called from a Tripwire's thread too
        self._cache: dict[int, float] = {}
        self._stamp: tuple[int, int] | None = None
        self._read_at = 0.0

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

    def records(self, fresh: bool = False) -> dict[int, float]:
        """:func:`jaxft.protocol.recorded_deaths`, re-read only when the records directory changed (it is polled), or
        ``fresh`` (the caller knows it changed). Thread-safe: the ready watcher reads it too."""
        if self.state_dir is None:  # no launcher: no records
            return {}
        state_dir = self.state_dir
        try:
            st = os.stat(os.path.join(state_dir, protocol.DEATHS))
            stamp = (st.st_mtime_ns, st.st_ino)
        except OSError:
            return {}
        with self._lock:
            if fresh or self._stamp != stamp or time.time() - self._read_at > 0.25:
                self._cache, self._stamp, self._read_at = protocol.recorded_deaths(state_dir), stamp, time.time()
            return self._cache

    def restarted(self, pids: Sequence[int], known: Mapping[int, int]) -> dict[int, str]:
        """Those of ``pids`` whose life in ``known`` is over by the lives they registered, with why
        (:func:`jaxft.worker.lives.over`: a newer life registered, a restart; its launcher
        retired it or recorded its exit). A restart on another node, after the service declared its
        previous life dead, is counted in a query over its process id at once: a member that
        asked such a query after the restart connected waited for it until its barrier
        timeout (the protocol's simulation: 1,246 of 10,000 schedules ended so, 7 with this)."""
        registered = lives_lib.all_current()
        over = {p: lives_lib.over(registered[p], known[p], self.state_dir) for p in pids
                if p in known and p in registered}
        return {p: why for p, why in over.items() if why is not None}

    def dead(self, pids: Sequence[int], fresh: bool = False) -> set[int]:
        """Those of ``pids`` whose current life, as this process knows it, was recorded dead
        (a life it knows nothing of never counts: the heartbeat decides then); ``fresh``:
        re-read the records (see :meth:`_records`)."""
        if not self.state_dir:
            return set()
        rec = self.records(fresh)
        return {p for p in pids if p in rec and p in self.since and rec[p] > self.since[p][1]}

    def live_nodes(self, query: Callable[[list[int]], Mapping[Any, Any]], pids: Sequence[int],
                   admitted: Mapping[int, int] | None = None, give_up: Callable[[], bool] | None = None,
                   lives: Mapping[int, int] | None = None,
                   on_confirm: Callable[[list[int]], None] | None = None) -> dict[int, int]:
        """``query(pids)`` (a ``get_live_nodes`` barrier), re-asked without any process the
        launcher records dead while waiting, until an answer names every process asked (with
        the incarnation ``lives`` gives, for those it names).

        The service matches liveness queries by their process set alone, so every member
        must make the same sequence of queries. A member that re-asks without a dead process
        registers a query over the smaller set; a member whose first query was answered by
        the service (it noticed the death by heartbeat) before it re-asked would go on, and
        its *next* query over that set (the next step's) would complete the re-asker's, one
        query out of step (both then wait for each other for ever: seen when a process died
        during the first step). So an answer smaller than its query is always confirmed by
        one more query over the answer: re-askers and confirmers meet in the same query. So is
        an answer that names a process of ``lives`` with another incarnation (its life ended:
        the launcher gives a process it saw die a new incarnation before it records the
        death, see :func:`jaxft._compat.retire_life`): a member that came late to a query the
        others left on that record gets such an answer from the query they left, and its
        confirmation meets their new query (without it, it committed the step they failed).

        An abandoned query stays open in the service, this process counted in, until every
        live process of its set has asked: if the dead process's next life joins a later
        query over that same set (``admitted``: the joiners being admitted, with the life each
        registered), its first ask would complete the old query alone and leave the members'
        new one waiting for it for ever. So a query over a set with an abandoned one waits on
        that one instead (the service counts this process in already), and takes its answer if
        it names each joiner with its admitted life (:func:`jaxft.core.liveness.reuse_left_query`:
        possibly before this member admitted it; another answer is an older query's).

        A final answer without a life of ``lives`` is marked (:func:`jaxft.protocol.mark_dropped`):
        once every member marked it, the restart of that process connects (see
        :func:`jaxft.protocol.restart_may_connect`).

        ``give_up()`` (checked while waiting) abandons the query and raises :class:`GaveUp`;
        ``on_confirm(pids)`` is called before a confirmation is asked (a cold start says so,
        :mod:`jaxft.worker.coldstart`). :attr:`asking`: the set asked last; :attr:`noticed`: the
        processes this call stopped waiting for, with why (the others it left out, the service did).
        """
        pids = sorted(pids)
        self.noticed = {}
        while True:
            known = {**(lives or {}), **{p: life for p, life in (admitted or {}).items() if life >= 0}}
            answer = self._ask_once(query, pids, admitted or {}, give_up, known)
            asked = answer.pop(_ASKED)
            move = liveness.on_answer(asked, answer, lives)
            if isinstance(move, liveness.Done):
                for p in (lives or {}):  # a restart of p may connect once every member dropped it
                    if move.answer.get(p) != lives[p]:  # type: ignore[index]
                        protocol.mark_dropped(p)
                return dict(move.answer)
            pids = list(move.pids)  # confirm the survivors (see above)
            if on_confirm is not None:
                on_confirm(pids)

    def _ask_once(self, query, pids: list[int], admitted: Mapping[int, int],
                  give_up: Callable[[], bool] | None, known: Mapping[int, int]) -> dict:
        """One answer, re-asking without dead processes (recorded dead, or restarted: of
        ``known``, the life each is expected with); the answer carries the set last asked."""
        if not self.state_dir and give_up is None:
            return {**{int(p): int(i) for p, i in query(pids).items()}, _ASKED: pids}
        while True:
            self.asking = tuple(pids)
            future = self._reuse(tuple(pids), admitted) or _ask(query, pids)
            again: liveness.Ask | None = None
            lives_every = self.LIVES_CHECK_S
            check_lives_at = time.monotonic() + lives_every
            while True:
                try:
                    answer = future.result(timeout=self.poll_s * 4)
                except concurrent.futures.TimeoutError:
                    if future.done():  # the query itself raised a TimeoutError (the same class):
                        raise  # else this loop would re-raise it for ever, its traceback growing
                    why = dict.fromkeys(self.dead(pids), "its launcher recorded its exit")
                    if known and time.monotonic() >= check_lives_at:
                        lives_every = min(2 * lives_every, max(self.LIVES_CHECK_MAX_S, self.LIVES_CHECK_S))
                        check_lives_at = time.monotonic() + lives_every
                        why = {**self.restarted(pids, known), **why}
                    again = liveness.on_deaths(pids, set(why))
                    if again is not None and not future.done():  # (an answer that came meanwhile is taken)
                        self.noticed.update(why)
                        break
                    if give_up is not None and give_up() and not future.done():
                        self._abandon(tuple(pids), future)
                        raise GaveUp(pids) from None
                    continue
                return {**{int(p): int(i) for p, i in answer.items()}, _ASKED: pids}
            self._abandon(tuple(pids), future)
            pids = list(again.pids)

    def _abandon(self, key: tuple[int, ...], future: concurrent.futures.Future) -> None:
        """Leave ``future``'s query (still open in the service, this process counted in), for
        :meth:`_reuse`."""
        self._abandoned[key] = (future, False)

    def adopted(self, entry: Mapping[int, int]) -> None:
        """This process enters a step on the others' ``entry`` (:mod:`jaxft.core.coldstart`): a
        query over that set it left and that is still open is completed by their next ask over
        it (the step's exit query), so its own next ask there takes that query, answered or not
        (:func:`jaxft.core.liveness.reuse_left_query`). One answered already was theirs to
        enter with."""
        key = tuple(sorted(entry))
        left = self._abandoned.get(key)
        if left is not None and not left[0].done():
            self._abandoned[key] = (left[0], True)

    def _reuse(self, key: tuple[int, ...], admitted: Mapping[int, int]) -> concurrent.futures.Future | None:
        """The query over ``key`` this process left earlier, if it must wait on that one instead
        of asking anew (:func:`jaxft.core.liveness.reuse_left_query`)."""
        left = self._abandoned.pop(key, None)
        if left is None:
            return None
        future, adopted = left
        answer = None
        if future.done():
            try:
                answer = {int(p): int(i) for p, i in future.result().items()}
            except Exception:  # noqa: BLE001 - a failed old query: ask again
                return None
        return future if liveness.reuse_left_query(future.done(), answer, admitted, adopted) else None


class Tripwire:
    """While armed over a step's members, calls ``action(dead)`` once if the launcher records
    one of them dead (a daemon thread).

    On Linux the thread sleeps until a record lands (:class:`jaxft.worker.dirwatch.DirWatch`), so an
    armed tripwire costs nothing while nobody dies; an arming checks the records only when
    they may say something new to it (other members than the last check's, a record that
    landed while it was disarmed, or a fire since), and every ``SAFETY_S`` anyway. Elsewhere
    it polls every ``poll_s`` while armed."""

    SAFETY_S = 0.25

    def __init__(self, watch: DeathWatch, action: Callable[[set[int]], None], poll_s: float = 0.01):
        self.watch, self.action, self.poll_s = watch, action, poll_s
        self._cond = threading.Condition()
        self._armed: tuple[int, ...] | None = None
        self._epoch = 0
        self._checked: tuple[int, ...] | None = None  # members of the last check that found nobody
        self._dirty = True  # the records may have changed since that check
        self._dir: dirwatch.DirWatch | None = None
        if watch.state_dir:
            self._dir = dirwatch.DirWatch(os.path.join(watch.state_dir, protocol.DEATHS))
            run = self._run_native if self._dir.native else self._run_polling
            threading.Thread(target=run, daemon=True, name="jaxft-tripwire").start()

    def arm(self, pids: Sequence[int]) -> None:
        with self._cond:
            self._armed, self._epoch = tuple(pids), self._epoch + 1
            check = self._dirty or self._armed != self._checked
            self._cond.notify()
        if check and self._dir is not None and self._dir.native:
            self._dir.wake()

    def disarm(self) -> None:
        with self._cond:
            self._armed = None

    def _check(self, pids: tuple[int, ...], epoch: int, fresh: bool) -> bool:
        """Fire if one of ``pids`` (armed at ``epoch``) is recorded dead and still armed; True
        if a look is owed to an arming made meanwhile (it found a death, but not for it)."""
        gone = self.watch.dead(pids, fresh=fresh)
        owed = False
        with self._cond:
            fire = bool(gone) and self._armed is not None and self._epoch == epoch
            if fire:
                self._armed, self._dirty = None, True  # once per arming; the next one looks again
            elif not gone and self._epoch == epoch:
                self._checked, self._dirty = pids, False
            elif gone:  # re-armed or disarmed under the check: the next arming looks again
                self._dirty = True
                owed = self._armed is not None
        if fire:
            self.action(gone)
        return owed

    def _run_native(self) -> None:
        assert self._dir is not None
        changed = True
        while True:
            with self._cond:
                pids, epoch = self._armed, self._epoch
                if pids is None and changed:
                    self._dirty = True  # a record landed between steps: the next arming looks
            if pids is not None and self._check(pids, epoch, fresh=True):
                changed = True
                continue
            changed = self._dir.wait(self.SAFETY_S)

    def _run_polling(self) -> None:
        while True:
            with self._cond:
                while self._armed is None:
                    self._cond.wait()
                pids, epoch = self._armed, self._epoch
            self._check(pids, epoch, fresh=False)
            if self._armed is not None:
                time.sleep(self.poll_s)


class Canceller:
    """Sets the event of the wait in progress the moment the launcher records one of its
    processes dead: what makes a key-value barrier (:class:`jaxft.worker.kv.KVBarrier`) give up at
    once instead of at its timeout. One :class:`Tripwire` thread, armed per wait."""

    def __init__(self, watch: DeathWatch):
        self.watch = watch
        self._event = threading.Event()
        self._tripwire = Tripwire(watch, self._fire)

    def _fire(self, dead: set[int]) -> None:
        event = self._event
        event.dead = set(dead)  # type: ignore[attr-defined]  # for the message of whoever gives up
        event.set()

    @contextlib.contextmanager
    def during(self, event: threading.Event, pids: Sequence[int]) -> Iterator[None]:
        """While inside, ``event`` is set if one of ``pids`` is recorded dead (its ``dead``
        attribute then names them: a barrier may meet the event before it waits at all)."""
        self._event = event
        self._tripwire.arm(pids)
        try:
            yield
        finally:
            self._tripwire.disarm()

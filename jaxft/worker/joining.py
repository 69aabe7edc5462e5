"""Ready admission, the group's side: how a process enters the members' step, and how the
members let it in.

A restarted (or late) process does its set-up while the members keep committing steps at
their width. Its first step (:meth:`Joining.entry_query` with a
:class:`~jaxft.core.commit.FirstStep` plan) either finds no running members (a cold start:
every process forms the first member set) or announces itself ready and waits until the
members' votes admit it (:mod:`jaxft.worker.admission` holds the key-value protocol of both).
The members vote inside their step (:meth:`Joining.votes`) and admit at its commit
(:meth:`Joining.admit`); the joiner is met at their next step's entry query.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import jax

from jaxft import priority, protocol
from jaxft.core import coldstart as coldstart_core
from jaxft.core import commit as commit_core
from jaxft.core import spares as spares_core
from jaxft.errors import BarrierTimeout
from jaxft.timeouts import Timeouts
from jaxft.worker import admission as admission_lib
from jaxft.worker import coldstart, kv
from jaxft.worker import deaths as deaths_lib
from jaxft.worker import lives as lives_lib
from jaxft.worker.hang import HangMonitor
from jaxft.worker.watchdog import hard_exit

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)
_STARTED_AT = time.time()  # (imported at this process's start-up; a standby's: lives_lib.process_started_at)

Watch = Callable[..., contextlib.AbstractContextManager]


class Joining:
    """One process's admission state (ready admission).

    Args:
      process_id: this process.
      timeouts: ``admission`` bounds the wait for the members to drop this process's
        previous life; ``heartbeat`` sets how long the joiner waits for gone members.
      hang: the step monitor (set-up before admission is exempt from its deadline).
      step: the step protocol's state (:class:`jaxft.core.commit.MemberStep`).
      watch: bounds one barrier wait (:meth:`jaxft.worker.watchdog.Watchdog.watch`).
      run_finished: whether the peers finished the run this process is in.
      nobody_runs: the launcher said no member runs (a cold start whatever the service holds).
      spares: the processes that start as hot spares (:mod:`jaxft.core.spares`): never part of
        a cold start's member set; such a process waits for the members to start, then to take it in.
    """

    def __init__(self, process_id: int, timeouts: Timeouts, hang: HangMonitor, step: commit_core.MemberStep,
                 watch: Watch, run_finished: Callable[[], bool], nobody_runs: bool,
                 spares: frozenset[int] = frozenset()):
        self.process_id, self.timeouts, self.hang, self.step = process_id, timeouts, hang, step
        self._watch, self._run_finished, self._nobody_runs = watch, run_finished, nobody_runs
        self._spares = spares
        # the number of members the run trains with (None: no spares, every live process is one)
        self.width = len(spares_core.initial(spares, jax.process_count())) if spares else None
        self._before_announce: list[tuple[Callable[[tuple[int, ...]], None], bool]] = []
        self._after_announce: list[Callable[[tuple[int, ...]], None]] = []
        self._as_spare: list[Callable[[tuple[int, ...]], None]] = []  # a spare's set-up instead of the others
        self._on_cold_start: list[Callable[[], None]] = []
        self._admitted_by: dict[int, int] = {}  # the members (process -> incarnation) that admitted this process
        self._admitted: dict[int, int] = {}  # the joiners being admitted -> the life each registered
        self._watcher: admission_lib.ReadyWatcher | None = None
        # when _join last found nobody running: the members records written before then are of
        # lives it saw gone (a cold start's watch counts only later ones); None: it did not look
        self._stale_before: float | None = None

    # -- hooks ------------------------------------------------------------------------
    def before_admission(self, hook: Callable[[tuple[int, ...]], None], may_raise: bool = False,
                         announced: bool = False, spare: bool = False) -> None:
        """See :meth:`jaxft.ElasticGroup.before_admission`."""
        if spare:
            self._as_spare.append(hook)
        elif announced:
            self._after_announce.append(hook)
        elif may_raise:
            self._before_announce.insert(0, (hook, True))
        else:
            self._before_announce.append((hook, False))

    def on_cold_start(self, hook: Callable[[], None]) -> None:
        """See :meth:`jaxft.ElasticGroup.on_cold_start`."""
        self._on_cold_start.append(hook)

    def committed(self) -> None:
        """This life committed a step: a put-off cold-start set-up is never needed in it."""
        self._on_cold_start = []

    # -- a joiner's way in ------------------------------------------------------------
    def entry_query(self, client, plan: commit_core.QueryEntry | commit_core.FirstStep,
                    deaths: deaths_lib.DeathWatch, incarnation: int | None,
                    last_entry: Mapping[int, int] | None = None) -> dict[int, int]:
        """The step's entry liveness query over the members plus those admitted at the last
        commit; on this process's first step over what :meth:`_join` says (``incarnation``:
        this life's, as it registered, :func:`jaxft.worker.lives.register`; ``last_entry``: the
        entry of the last step it entered, None before its first)."""
        switch: tuple[int, ...] | None = None  # the set a stranded cold start's process asks instead
        give_up: coldstart.ColdStartWatch | coldstart.EntryWatch | None = None
        confirm = None
        while True:
            admitted: dict[int, int] = {}
            lives: Mapping[int, int] | None = None
            if switch is not None:
                # (with the cold start's watch: the others may yet enter a step with this life
                # on the query over the cold set it left, where the service counts it in)
                pids, switch = list(switch), None
            elif isinstance(plan, commit_core.FirstStep):
                joined = self._join(incarnation)
                if isinstance(joined, coldstart_core.Adopt):  # (the members' cold start: its set-up too)
                    deaths.adopted(joined.entry)
                    priority.restore()
                    self._run_cold_start_hooks()
                    return dict(joined.entry)
                pids, alive_at, cold = joined
                priority.restore()  # a restart set up niced (see jaxft.priority): it joins now
                # lives that died before alive_at - RESTART_GAP_S are earlier lives (a restart
                # connects no sooner after a death): a record counts only against a later one
                deaths.assume_alive_since(pids, alive_at - protocol.RESTART_GAP_S)
                if cold:
                    if self._run_finished():  # the members finished while this process set up: a
                        # cold start would train the run again from its checkpoint, alone
                        hard_exit(0, f"jaxft: the run finished before process {self.process_id} joined it; exiting 0")
                    self._run_cold_start_hooks()
                    # a cold start, as far as it could tell. If the others started without it (it
                    # came up late, or restarted after a death in their first step) or took an answer
                    # naming it from a query an earlier life of it entered, only this watch ends it
                    give_up = coldstart.ColdStartWatch(self.process_id, incarnation, pids, lambda: deaths.asking,
                                                      since=lives_lib.process_started_at(),
                                                      members_since=self._stale_before)
                    confirm = functools.partial(coldstart.publish_confirm, writer=self.process_id)
                else:  # admitted (coldstart.EntryWatch: as a member's entry query, below)
                    give_up = coldstart.EntryWatch(self.process_id, incarnation, lambda: deaths.asking,
                                                   expected=self._admitted_by, last_entry=None)
                    confirm = None
                # admitted: a member's state will replace what the put-off hooks would set up; they
                # are kept until this life's first commit, for the case the members die first
            else:
                pids, lives = list(plan.pids), plan.lives
                admitted = {p: self._admitted.get(p, -1) for p in plan.expect}  # (-1: not read)
                give_up = coldstart.EntryWatch(self.process_id, incarnation, lambda: deaths.asking,
                                               expected={**plan.lives, **admitted}, last_entry=last_entry)
                confirm = None
            try:
                with self._watch("entering a step"):
                    return deaths.live_nodes(client.get_live_nodes, pids, admitted=admitted, give_up=give_up,
                                             lives=lives, on_confirm=confirm)
            except deaths_lib.GaveUp:
                move = coldstart.told(self.process_id, give_up)
                if isinstance(move, coldstart_core.Adopt):
                    deaths.adopted(move.entry)
                    return dict(move.entry)
                switch = move.pids if isinstance(move, coldstart_core.Switch) else None

    def check_entry(self, entry: Mapping[int, int]) -> None:
        """Until this process's first commit: if none of the lives that admitted it is in the
        step it enters, the run ended (exit 0) or they all died, and the processes of this step
        start cold (the set-up each put off runs now, once, so the run goes on from the newest
        checkpoint rather than from a joiner's initial state)."""
        if not self.step.joining:
            return
        if self._admitted_by:
            gone = not any(entry.get(p) == i for p, i in self._admitted_by.items())
        else:
            gone = set(entry) == {self.process_id}
        if not gone:
            return
        deadline = time.monotonic() + 2.0  # members mark the run finished right after its last step
        while time.monotonic() < deadline:
            if self._run_finished():
                hard_exit(0, f"jaxft: the run finished as process {self.process_id} was admitted; exiting 0")
            time.sleep(0.1)
        logger.warning("process %d: the members that admitted it are gone; going on without them, from its "
                       "put-off set-up (the newest checkpoint, if any)", self.process_id)
        self._run_cold_start_hooks()

    def _run_cold_start_hooks(self) -> None:
        hooks, self._on_cold_start = self._on_cold_start, []
        with self.hang.busy():  # (a restore may take a while; nobody waits for it yet)
            for hook in hooks:
                hook()

    def _join(self, incarnation: int | None) -> tuple[list[int], float, bool] | coldstart_core.Adopt:
        """This process's first step: the barrier's process ids, when they were all alive, and
        whether this is a cold start (every process but the spares forms the first member set);
        when a run is going on, it waits to be admitted. A process that starts as a spare never
        starts cold: it waits for the members (bounded by ``Timeouts.admission``)."""
        cold = list(spares_core.initial(self._spares, jax.process_count()))  # a cold start's members
        spare = self.process_id in self._spares
        if self._run_finished():
            hard_exit(0, f"jaxft: the run finished before process {self.process_id} could join; exiting 0")
        if self._nobody_runs and not spare:  # a cold start: no member list to wait on, whatever the service holds
            self._nobody_runs = False
            # every earlier life died before this process started, and a death record counts
            # against a life seen alive up to 1 s before it (see entry_query)
            return cold, max(time.time(), max(_STARTED_AT, lives_lib.process_started_at()) + 1.0), True
        joiner = admission_lib.Joiner(self.process_id, self.timeouts)
        since = time.monotonic()
        self._stale_before = None
        while True:
            looked_at = time.time()
            running = joiner.running_members(settle_s=max(1.5, 0.5 * self.timeouts.heartbeat))
            if running is None and not spare:
                # the newest record's members did not beat: every record so far is of gone lives
                # (a cold start's watch must not take one for others running: design.md)
                self._stale_before = looked_at
                return cold, time.time(), True
            if running is not None and self.process_id not in running:
                admitted = self._wait_admitted(joiner, running, incarnation)
                if admitted is not None:
                    return admitted
                if not spare:  # every member died meanwhile: start with the others' restarts
                    logger.warning("process %d: the members stopped while it waited to be admitted; starting cold",
                                   self.process_id)
                    self._stale_before = time.time()  # (their records are of gone lives, as above)
                    return cold, time.time(), True
                since = time.monotonic()  # a spare waits for the members' restarts
            # Still listed: the members have not yet entered a step without this process's
            # previous life (they will once they saw it die), or a spare before they started, or
            # they entered one with this life on an answer it never got: it enters with them.
            if running is not None and (entry := coldstart.adopted_entry(self.process_id, incarnation)) is not None:
                logger.warning("process %d: the members entered a step with it on an answer it never got; "
                               "entering with them", self.process_id)
                return coldstart_core.Adopt(entry)
            if time.monotonic() - since > self.timeouts.admission:
                what = ("found no running members" if running is None
                        else "found the running members still listing its previous life")
                raise BarrierTimeout(f"process {self.process_id} {what} for {self.timeouts.describe('admission')}")
            time.sleep(0.2)

    def _wait_admitted(self, joiner: admission_lib.Joiner, running: list[int], incarnation: int | None
                       ) -> tuple[list[int], float, bool] | coldstart_core.Adopt | None:
        """Set up for ``running`` plus this process, say it is ready and wait to be admitted:
        the barrier's process ids and when they were alive; None if every member stopped meanwhile;
        their entry if they entered a step with this life (``incarnation``; Adopt). A spare (the
        members fill the width) waits as long as they run, one barrier bound at a time."""
        spare, me = self.width is not None and len(running) >= self.width, (self.process_id, incarnation)
        expected = tuple(sorted(set(running) | {self.process_id}))
        self._set_up(expected, compile_ahead=not spare)
        joiner.announce()
        for hook in self._after_announce:  # (the "ready" fault point)
            hook(expected)
        t0 = time.monotonic()
        while True:
            # (exits 0 if the run finishes meanwhile; a spare never counts as waiting on a member)
            with self._watch("waiting to be admitted", notice=not spare):
                try:
                    admitted = joiner.wait_admitted(members_gone_s=self.timeouts.heartbeat + 2.0, width=self.width,
                                                    give_back_s=None if self.width is None
                                                    else 0.5 * self.timeouts.barrier,
                                                    entered=functools.partial(coldstart.adopted_entry, *me))
                except admission_lib.StillSpare:
                    continue  # (a new bound: a spare may wait for as long as the members run)
            break
        if admitted is None or isinstance(admitted, coldstart_core.Adopt):
            return admitted
        pids, alive_at, self._admitted_by = admitted
        self.step.joining = True
        logger.info("process %d admitted after %.2f s with %s", self.process_id, time.monotonic() - t0, pids)
        return pids, alive_at, False

    def _set_up(self, expected: tuple[int, ...], compile_ahead: bool = True) -> None:
        """The before-admission hooks, for the member set this process expects to enter
        (``compile_ahead`` False: a spare, whose member set is unknown until one dies, runs the
        checks, then the spare's own set-up; the members' warm-up compiled its programs,
        :mod:`jaxft.worker.warmup`)."""
        checks = [h for h, may_raise in self._before_announce if may_raise]
        set_up = [h for h, may_raise in self._before_announce if not may_raise] if compile_ahead else self._as_spare
        with self.hang.busy():  # a compile may take a while; nobody waits for this process yet
            for hook in checks:  # (a joiner they refuse must never be admitted)
                hook(expected)
            for hook in set_up:
                try:
                    hook(expected)
                except Exception:
                    logger.exception("process %d: set-up before admission failed", self.process_id)

    # -- the members' side ------------------------------------------------------------
    def votes(self, process_ids: Sequence[int], deaths: deaths_lib.DeathWatch | None) -> np.ndarray:
        """This member's view of the ready joiners (int32 per process id; none while the
        members fill the width: :func:`jaxft.core.spares.own_admission`)."""
        if self._watcher is None:
            self._watcher = admission_lib.ReadyWatcher(jax.process_count(), deaths.records if deaths else dict)
        return spares_core.own_admission(self._watcher.votes(process_ids), process_ids, self.width)

    def admit(self, process_ids: Sequence[int], incarnations: Mapping[int, int], agreed_votes,
              deaths: deaths_lib.DeathWatch | None) -> tuple[int, ...]:
        """After a commit (or a step the members left to take a spare in): the joiners every
        member agreed on enter at the next step, no more than the width has room for
        (:func:`jaxft.core.spares.to_admit`)."""
        joiners = spares_core.to_admit(agreed_votes, process_ids, self.width)
        if joiners:
            self._let_in(process_ids, incarnations, joiners, deaths)
        return joiners

    def _let_in(self, process_ids: Sequence[int], incarnations: Mapping[int, int], joiners: tuple[int, ...],
                deaths: deaths_lib.DeathWatch | None) -> None:
        """``joiners``, agreed by every member, enter at the next step (with ``process_ids``)."""
        self.step.admit(joiners)
        self._admitted = _registered_lives(joiners)
        if deaths is not None:
            # a joiner is a new life (it connected >= RESTART_GAP_S after any earlier death
            # of its process id): earlier death records must not count against it
            deaths.assume_alive_since(joiners, time.time() - protocol.RESTART_GAP_S)
        assert self._watcher is not None
        self._watcher.admit(joiners, sorted(set(process_ids) | set(joiners)), incarnations)

    def after_failure(self, entry: Mapping[int, int], survivors: Mapping[int, int] | None, hold: bool,
                      deaths: deaths_lib.DeathWatch | None, ready: bool = True) -> tuple[int, ...]:
        """After a step over ``entry`` failed, leaving ``survivors`` (process -> life) below the
        width: the spares they take in at once, to enter at the next step. Each survivor proposes
        the ready spares it sees (none if it ``hold``s admissions) and all admit the first
        proposal (:func:`jaxft.core.spares.swap_key`, :func:`jaxft.worker.kv.propose`), without a
        step of their own at the narrower width first. An empty decision leaves it to the
        next step's votes (:func:`jaxft.core.spares.swap_first`). ``ready`` False (connect
        admission) or no ``survivors`` known: none."""
        if not ready or survivors is None or self._watcher is None or not spares_core.swap_first(survivors, self.width):
            return ()
        mine = () if hold else spares_core.to_admit(self._watcher.votes(list(survivors)), survivors, self.width)
        agreed = kv.propose(admission_lib.SWAP_PREFIX + spares_core.swap_key(entry), ",".join(map(str, mine)))
        joiners = tuple(int(p) for p in (agreed or "").split(",") if p)
        if joiners:
            self._let_in(list(survivors), survivors, joiners, deaths)
        return joiners

    def stop_watching(self) -> None:
        """The run ended: stop watching for joiners until the next run's first step."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None


def _registered_lives(pids: Sequence[int]) -> dict[int, int]:
    """The life (service incarnation) each of ``pids`` registered (:func:`jaxft.worker.lives.register`,
    done before a joiner says it is ready); -1 where none can be read, or the record is a dead
    life's retirement (a left query's answer is then not taken, it asks anew)."""
    registered = lives_lib.all_current()
    return {p: registered[p].incarnation if p in registered and not registered[p].retired else -1 for p in pids}

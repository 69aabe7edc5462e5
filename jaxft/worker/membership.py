"""The agreed live set and the atomic step, built on ``live_devices``.

``jax.experimental.multihost_utils.live_devices`` gives every live process the same set
of devices and makes its block commit everywhere or fail everywhere. :class:`ElasticGroup`
wraps it so users never meet its rough edges:

* members are reported per process (ids and coordination-service incarnations), with a
  generation number and who joined or left since the previous step;
* on CPU, when the set gains a member, the gloo data plane is rebuilt (stale rendezvous
  keys deleted, barrier, fresh backend) before the step body runs, so a restarted
  process can take part again (gloo caches communicators per device list, not per
  incarnation, and keeps the dead incarnation's rendezvous keys);
* after such a rebuild the remembered device map is re-keyed to the new device objects,
  so the next step does not fail spuriously;
* a failed step surfaces as :class:`StepFailed` naming the failed processes; any other
  exception propagates unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import jax
from jax.experimental import multihost_utils
from jax.extend import backend as jax_backend
from jax.sharding import Mesh

from jaxft import _compat, priority, protocol
from jaxft import timeouts as timeouts_lib
from jaxft.core import commit as commit_core
from jaxft.core import runs as runs_core
from jaxft.core.rejoin import is_new
from jaxft.errors import BarrierTimeout, StepFailed
from jaxft.protocol import EXIT_BARRIER_TIMEOUT
from jaxft.timeouts import Timeouts
from jaxft.worker import admission as admission_lib
from jaxft.worker import breaker, kv, lives, rendezvous
from jaxft.worker import deaths as deaths_lib
from jaxft.worker import runs as runs_lib
from jaxft.worker.hang import WAIT_NOTICE_S, HangMonitor

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)
_STARTED_AT = time.time()  # (imported at this process's start-up)


__all__ = ["ElasticGroup", "Members", "StepFailed"]


@dataclasses.dataclass(frozen=True)
class Members:
    """The agreed live set for one step."""

    devices: tuple[jax.Device, ...]  # sorted by device id
    mesh: Mesh  # 1-D mesh over ``devices`` with axis ``axis_name``
    process_ids: tuple[int, ...]
    incarnations: Mapping[int, int]  # process id -> coordination-service incarnation
    generation: int  # changes whenever the member map changes
    joined: tuple[int, ...]  # process ids new (or with a new incarnation) since last step
    left: tuple[int, ...]
    reset: bool  # the data plane was rebuilt at the start of this step
    gained: bool  # a member (maybe this process) is new since the last committed step:
    # joiners may need state. Every member computes the same value.
    mesh_is_new: bool = False  # first step on this device set: the step function compiles

    @property
    def size(self) -> int:
        return len(self.devices)


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """This process's ``run()`` as :meth:`ElasticGroup.begin_run` found it."""

    index: int  # 1 for the first run() of the program, 2 for the next, ...
    finished: bool  # the members finished it (and nothing runs after it): exit 0
    passed: bool  # the members are in a later run: catch up with them


def _member_map(device_map: Mapping[jax.Device, int]) -> dict[int, int]:
    return {d.process_index: int(inc) for d, inc in device_map.items()}


def _map_digest(member_map: Mapping[int, int]) -> str:
    text = ",".join(f"{p}:{i}" for p, i in sorted(member_map.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ElasticGroup:
    """Runs atomic steps over whichever processes are alive.

    Usage::

        group = ElasticGroup()
        try:
            with group.step() as members:
                ...  # all work of the step, ending in jax.block_until_ready
        except StepFailed as e:
            ...  # nothing was committed anywhere; retry on the survivors

    ``admission`` says when a restarted (or late) process becomes a member. ``"ready"``: it
    does all its set-up while the members keep committing steps at their width, and enters
    at a step boundary they all agree on (:mod:`jaxft.worker.admission`; the step must carry the
    votes, which :class:`~jaxft.ElasticLoop` and :class:`~jaxft.ElasticTrainer` do).
    ``"connect"``: it is a member as soon as ``jaxft.initialize()`` connects, and the members
    wait for its set-up at their next step. ``None`` (default): ready under an
    ``ElasticLoop``/``ElasticTrainer``, connect for a bare ``group.step()`` loop like the one
    above (nothing there carries votes, so a ready joiner would never enter).
    """

    def __init__(self, axis_name: str = "data", barrier_timeout_s: float | None = None, poll_s: float = 0.5,
                 timeouts: Timeouts | None = None, admission: str | None = None):
        if admission not in (None, "connect", "ready"):
            raise ValueError(f"admission must be 'connect', 'ready' or None, got {admission!r}")
        # ready: a process stays out of the members' barrier until admitted (jaxft.worker.admission;
        # the step must carry the votes, as ElasticLoop and ElasticTrainer do); connect: it is
        # a member from its first step, and the members wait for its set-up at their next step.
        # None: ready under an ElasticLoop (it carries the votes), connect for a bare
        # ``group.step()`` loop (nothing would carry them: a restarted process would never enter).
        self.admission = admission
        self._step = commit_core.MemberStep()  # the step protocol's state (ready admission; jaxft.core.commit)
        self._admitted_at: float | None = None  # when the joiners being admitted were admitted
        self.before_exit_query: Callable[[], None] | None = None  # (the loop's in-commit fault point)
        self._marked_commit = False  # this life's first commit is marked for its launcher
        self._watcher: admission_lib.ReadyWatcher | None = None
        self._admitted_by: dict[int, int] = {}  # the members (process -> incarnation) that admitted this process
        self._published: tuple[int, ...] | None = None
        self._deaths: deaths_lib.DeathWatch | None = None
        self._tripwire: deaths_lib.Tripwire | None = None
        self._reset_canceller: deaths_lib.Canceller | None = None  # cancels the rebuild's barriers on a death
        self._last_reset_ns: str | None = None
        self.life: lives.Life | None = None  # this process's registered life (jaxft.worker.lives)
        self.axis_name = axis_name
        self.timeouts = (timeouts or timeouts_lib.current()).replace(barrier=barrier_timeout_s)
        self.barrier_timeout_s = self.timeouts.barrier
        self.poll_s = poll_s
        self.process_id = jax.process_index()
        self.platform = jax.devices()[0].platform
        self.generation = 0
        self.target: int | None = None  # the step the current run trains to (set by begin_run)
        self.run_index = 0  # how many run()s this process began (jaxft.worker.runs)
        self._defer = False  # the step in progress leaves its commit to the next step's query (defer_commit)
        self.deferred = 0  # steps whose exit query was left to a later step's (see defer_commit)
        self._previous: dict[int, int] | None = None  # member map of the previous step
        self._synced: dict[int, int] | None = None  # member map the data plane was built for
        self._reset_attempts: dict[str, int] = {}
        self.last_reset: dict[str, float] = {}  # seconds spent in the last data-plane rebuild, by part
        # A step failed after its body began: the CPU communicators built so far are suspect.
        # gloo caches them per device list; an aborted all-reduce can leave a partial message
        # on a pair, which the next collective would read as its own ("Received data size
        # doesn't match expected size", SIGABRT), and a member whose collective failed broke
        # its connections (jaxft.worker.breaker), which every pair with it shares. A step over a
        # suspect list rebuilds the data plane first; a step over a list not used since the
        # last rebuild gets a fresh communicator from gloo, so survivors of a failure go on at
        # their narrower width without a rebuild (and keep their compiled executables). Every
        # member of a failed step sees the same failure and the same history of lists since
        # the last rebuild, so all of them decide alike.
        self._used: set[tuple[int, ...]] = set()  # process-id lists stepped on since the last rebuild
        self._suspect: set[tuple[int, ...]] = set()
        self._meshes: dict[tuple[int, ...], Mesh] = {}
        self._pre_reset: list[Callable[[], None]] = []
        self._post_reset: list[Callable[[], None]] = []
        self._before_announce: list[tuple[Callable[[tuple[int, ...]], None], bool]] = []
        self._on_cold_start: list[Callable[[], None]] = []
        # jaxft launch's word on a restart: a member may run on (True), none does (False: every
        # local worker died in the same failure, one node), or nothing said (None)
        self.peers_may_run: bool | None = protocol.peers_may_run(os.environ)
        self._nobody_runs = self.peers_may_run is False  # (consumed by the first step's _join)
        self._watchdog: _Watchdog | None = None
        self._old_backends: list[tuple[weakref.ref, float]] = []  # (a client a rebuild replaced, when)
        self.leaked_backends = 0  # rebuilds after which arrays of the old backend stayed alive
        self.hang = HangMonitor(self.process_id, self.timeouts, poll_s=poll_s)

    # -- hooks ------------------------------------------------------------------------
    def on_reset(self, before: Callable[[], None] | None = None,
                 after: Callable[[], None] | None = None) -> None:
        """Register callbacks around a data-plane rebuild (arrays die with the backend:
        move them to host in ``before``, rebuild them in ``after``)."""
        if before is not None:
            self._pre_reset.append(before)
        if after is not None:
            self._post_reset.append(after)

    def before_admission(self, hook: Callable[[tuple[int, ...]], None], may_raise: bool = False) -> None:
        """Register ``hook(process_ids)``, run by a joiner (ready admission) with the member set it
        expects to enter, before it tells the members it is ready: set-up done there (compiling
        the step for that set) costs the members nothing. An error of such a hook is logged
        and ignored (the step does that work then), unless ``may_raise`` (a check that must
        stop the joiner before it is admitted: those run first)."""
        if may_raise:
            self._before_announce.insert(0, (hook, True))
        else:
            self._before_announce.append((hook, False))

    def members_listed(self) -> bool:
        """Whether the members of a running job have published their list (one key-value
        read). A stale list, of members that all died, is told apart from a live one only at
        this process's first step (whose heartbeat test takes up to ``max(1.5 s, heartbeat /
        2)``): set-up put off on this answer registers :meth:`on_cold_start` for that case."""
        return admission_lib.Joiner(self.process_id, self.timeouts).listed_members() is not None

    def on_cold_start(self, hook: Callable[[], None]) -> None:
        """Register ``hook()``, run once if this process's first step (ready admission) turns
        out to be a cold start rather than an admission into a running set: set-up that only a
        cold start needs (a checkpoint restore, which an admitted process would throw away for
        a member's state) deferred until that is known."""
        self._on_cold_start.append(hook)

    def busy(self):
        """Context manager: legitimately long work between steps, exempt from the step deadline
        (e.g. an evaluation that only some processes run while the others wait)."""
        return self.hang.busy()

    @property
    def needs_data_plane_reset(self) -> bool:
        """CPU (gloo) caches communicators per device list without incarnations."""
        return self.platform == "cpu"

    def mesh(self, devices: Sequence[jax.Device]) -> Mesh:
        """A cached 1-D mesh over ``devices``."""
        key = tuple(d.id for d in devices)
        mesh = self._meshes.get(key)
        if mesh is None:
            mesh = Mesh(list(devices), (self.axis_name,))
            self._meshes[key] = mesh
        return mesh

    # -- the step ---------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self) -> Iterator[Members]:
        """Enter one atomic step; raises :class:`StepFailed` if a member died during it.

        The barriers at entry and exit are watched: if the peers finished the run
        (:meth:`finish`) while this process waits for them, it exits 0; if a barrier
        outlasts ``Timeouts.barrier``, it exits with :data:`EXIT_BARRIER_TIMEOUT`
        rather than hang forever (``live_devices`` has no timeout of its own).
        """
        if self.life is None:  # before this life's first liveness query: every member map names a registered life
            self.life = lives.register()
        if self.admission is None:  # a bare loop (an ElasticLoop would have chosen ready)
            self.admission = "connect"
        if self.admission == "ready":
            with self._ready_step() as members:
                yield members
            return
        priority.restore()  # a restart set up niced (see jaxft.priority): it is a member from now on
        cm = multihost_utils.live_devices(jax.devices())
        members: Members | None = None
        try:
            with self._watch("entering a step"):
                devices = cm.__enter__()
            try:
                self.hang.step_started()
                members = self._enter(devices, _compat.live_device_map())
                if members.reset or members.gained or members.mesh_is_new:
                    self.hang.long_step()  # a compile or a rejoin: bounded by Timeouts.setup
                yield members
            except BaseException as e:
                if not isinstance(e, Exception):
                    raise  # SystemExit (the SIGTERM handler's), KeyboardInterrupt: leaving, not a failed step
                self._break_if_collective_failed(e)
                with self._watch("leaving a failed step", publish=True):
                    if not cm.__exit__(type(e), e, e.__traceback__):
                        raise
            else:
                with self._watch("leaving a step"):
                    cm.__exit__(None, None, None)
                self._step.agreed = dict(members.incarnations)
                self._mark_committed()
        except multihost_utils.ProcessFailureError as e:
            if members is not None:
                self._taint()
            raise StepFailed({d.process_index for d in e.failed_devices}, e.__cause__) from e
        finally:
            self.hang.phase("between steps")
            _compat.rekey_live_devices(jax.devices())

    def defer_commit(self) -> None:
        """Inside a :meth:`step` (ready admission) whose body succeeded: leave this step's
        exit query to the next step's, which then commits both or neither.

        What makes it safe: every member of the step decides alike (the caller's decision
        must rest on what the members share, see ``ElasticLoop(commit_every=...)``), and a
        member whose body fails makes its query anyway: the others' next step meets it
        there, as their next collective fails without it, so every member still makes the
        same sequence of liveness queries (the service matches them by process set).
        """
        if self.admission != "ready":
            raise ValueError("defer_commit needs ready admission (its steps skip the liveness query at entry)")
        self._defer = True

    @contextlib.contextmanager
    def _ready_step(self) -> Iterator[Members]:
        """The step of ready admission: ``live_devices``' protocol on ``get_live_nodes``, with a
        query at entry only when needed, and the exit query over the entry's live set.

        In steady state a step costs one round trip, as with ``live_devices``: the exit query
        of step k (the commit) is the entry set of step k+1. An entry query is made on the
        first step, after a failed step, and when joiners were admitted (it is where they
        meet the members; a process that dies between steps is then met in the next step's
        collective, which fails at once everywhere, see :mod:`jaxft.worker.breaker`). The exit
        query runs over the processes that entered, so a restarted incarnation of a process
        that was left out is never pulled into the members' barrier before it is ready
        (``live_devices`` would query its argument again).
        """
        client = kv.client()
        if self._deaths is None:
            self._deaths = deaths_lib.DeathWatch()
        plan = self._step.plan_entry()
        if isinstance(plan, commit_core.UseCommitted):
            entry = dict(plan.entry)  # the last commit's live set: no round trip
        else:
            entry = self._entry_query(client, plan)
        if self._published != tuple(sorted(entry)):
            # every member got the same entry answer: each tells joiners who runs, with its own
            # heartbeat (one write per member when the members change, none in steady state)
            self._published = tuple(sorted(entry))
            admission_lib.publish_members(self._published, self.process_id)
        if self._step.joining and self._members_gone(entry):  # (until its first commit)
            self._left_without_members()
        self._step.entered(entry)  # (nothing committed until it exits)
        self._deaths.saw(entry)
        live_map = {d: entry[d.process_index] for d in jax.devices() if d.process_index in entry}
        error: BaseException | None = None
        members: Members | None = None
        tripwire = self._tripwire_for(entry)
        try:
            self.hang.step_started()
            members = self._enter(list(live_map), live_map)
            if members.reset or members.gained or members.mesh_is_new:
                self.hang.long_step()  # a compile or a rejoin: bounded by Timeouts.setup
            if tripwire is not None:
                tripwire.arm([p for p in entry if p != self.process_id])
            yield members
        except BaseException as e:  # noqa: BLE001 - re-raised below unless a member failed
            error = e
            self._break_if_collective_failed(e)
        finally:
            if tripwire is not None:
                tripwire.disarm()
        defer, self._defer = self._defer, False
        if error is not None and not isinstance(error, Exception):
            self.hang.phase("between steps")
            raise error  # SystemExit (the SIGTERM handler's), KeyboardInterrupt: leaving, not a failed step
        if defer and error is None:  # the next step's query commits this one too (defer_commit)
            self.hang.phase("between steps")
            self.deferred += 1
            self._step.defer(entry)
            return
        try:
            with self._watch("leaving a failed step" if error is not None else "leaving a step",
                             publish=error is not None):
                if self.before_exit_query is not None:
                    self.before_exit_query()
                exit_ = self._deaths.live_nodes(client.get_live_nodes, sorted(entry), lives=entry)
        finally:
            self.hang.phase("between steps")
        outcome = self._step.exited(entry, exit_, body_ok=error is None)
        if outcome is commit_core.Outcome.FAIL:
            if members is not None:
                self._taint()
            raise StepFailed(set(commit_core.failed_members(entry, exit_)), error) from error
        if outcome is commit_core.Outcome.ERROR:
            assert error is not None
            raise error
        self._on_cold_start = []  # committed: a put-off restore is never needed in this life
        self._mark_committed()

    @property
    def joining(self) -> bool:
        """Admitted into a running set (ready admission), until this process's first commit."""
        return self._step.joining

    def _mark_committed(self) -> None:
        """Once per life, mark its first commit for the launcher's crash-loop guard (a life that
        committed is never taken for a set-up that crashes alike, :mod:`jaxft.supervisor.crashloop`)."""
        if not self._marked_commit:
            self._marked_commit = True
            protocol.mark_life(protocol.COMMITTED, "this life's first commit")

    @contextlib.contextmanager
    def _deaths_cancel(self, cancel: threading.Event, members: Sequence[int]) -> Iterator[None]:
        """While inside, ``cancel`` is set the moment the launcher records one of ``members`` dead
        (:class:`jaxft.worker.deaths.Canceller`; nothing without records or a DeathWatch)."""
        others = [p for p in members if p != self.process_id]
        if self._deaths is None or not self._deaths.state_dir or not others:
            yield
            return
        if self._reset_canceller is None:
            self._reset_canceller = deaths_lib.Canceller(self._deaths)
        with self._reset_canceller.during(cancel, others):
            yield

    def _tripwire_for(self, entry: Mapping[int, int]) -> deaths_lib.Tripwire | None:
        """The step body's tripwire: a member recorded dead breaks this process's CPU data
        plane at once (the body's collective then fails here, whichever pair it waits on)."""
        if not self.needs_data_plane_reset or len(entry) < 2 or not self._deaths.state_dir:
            return None
        if self._tripwire is None:
            def trip(dead: set[int]) -> None:
                n = breaker.break_data_plane()
                logger.info("process %d: members %s recorded dead during the step; broke %d connections",
                            self.process_id, sorted(dead), n)
                self.hang.doomed(f"member(s) {sorted(dead)} died")  # bounds a send gloo leaves pending

            self._tripwire = deaths_lib.Tripwire(self._deaths, trip)
        return self._tripwire

    def _report_old_backends(self) -> None:
        """At :meth:`finish`, warn for each rebuild whose replaced CPU backend still has arrays.

        A jax array of it that is still referenced (the initial params the program created,
        a numpy view made by ``np.asarray`` of one) keeps the old backend's buffers alive for
        nothing, once per rebuild (in one A/B pair of runs the new backend's steps were also
        slower with it, 0.160 s against 0.140 s; not settled, see README). Warn, naming the fix.

        Only here, once: arrays that are garbage in reference cycles are listed too until a
        full ``gc.collect`` (~50-200 ms with jax loaded), and run a few seconds after every
        admission it stalled the step it fell in on every member (schedule runs here)."""
        olds, self._old_backends = self._old_backends, []
        listed = [(ref, when) for ref, when in olds if _held_arrays(ref())]
        if not listed:
            return
        gc.collect()
        now = time.monotonic()
        for ref, when in listed:
            held = _held_arrays(ref())
            if held:  # (the client itself may outlive the rebuild in jax's caches; its arrays must not)
                self.leaked_backends += 1
                logger.warning("process %d: arrays of the CPU backend replaced %.0f s ago are still alive (%s): "
                               "something holds them (e.g. the initial params, or numpy views of them made by "
                               "np.asarray) and with them that backend's memory; pass host copies (np.array) "
                               "to the trainer and keep no jax arrays across steps", self.process_id,
                               now - when, ", ".join(held[:12]))

    def _taint(self) -> None:
        """A step failed after its body began: rebuild the CPU data plane before the next one."""
        if self.needs_data_plane_reset:
            self._suspect |= self._used

    def _break_if_collective_failed(self, error: BaseException) -> None:
        """This process's collective failed: fail the others' now too (see :mod:`jaxft.worker.breaker`)."""
        if self.needs_data_plane_reset and jax.process_count() > 1 and breaker.is_collective_failure(error):
            breaker.break_data_plane()
            self._suspect |= self._used

    # -- admission (admission="ready") -------------------------------------------------
    def _entry_query(self, client, plan: commit_core.QueryEntry | commit_core.FirstStep) -> dict[int, int]:
        """The step's entry liveness query over the members plus those admitted at the last
        commit; on this process's first step over what :meth:`_join` says."""
        while True:
            give_up, first, cold = None, isinstance(plan, commit_core.FirstStep), False
            expect: frozenset[int] = frozenset()
            lives: Mapping[int, int] | None = None
            if first:
                pids, alive_at, cold = self._join()
                priority.restore()  # a restart set up niced (see jaxft.priority): it joins now
                # lives that died before alive_at - 1 s are earlier lives (a restart connects only
                # heartbeat + 1.5 s after a death): a record counts only against a later one
                self._deaths.assume_alive_since(pids, alive_at - 1.0)
                if cold:
                    if self.run_finished():  # the members finished while this process set up: a cold
                        # start would train the run again from its checkpoint, alone
                        _hard_exit(0, f"jaxft: the run finished before process {self.process_id} joined it; exiting 0")
                    hooks, self._on_cold_start = self._on_cold_start, []
                    with self.hang.busy():  # (a restore may take a while; nobody waits for it yet)
                        for hook in hooks:
                            hook()
                    # a cold start, as far as this process could tell: if the others started
                    # without it meanwhile (it came up late, or is the restart of one that
                    # died in their first step), this query would never be answered
                    give_up = admission_lib.started_without(self.process_id)
                # admitted: a member's state will replace what the put-off hooks would set up; they
                # are kept until this life's first commit, for the case the members die first
            else:
                pids, expect, lives = list(plan.pids), plan.expect, plan.lives
            try:
                with self._watch("entering a step"):
                    entry = self._deaths.live_nodes(client.get_live_nodes, pids, expect=expect,
                                                    give_up=give_up, since=self._admitted_at, lives=lives)
                return entry
            except deaths_lib.GaveUp:
                logger.info("process %d: the others started without it; joining them", self.process_id)

    def _members_gone(self, entry: Mapping[int, int]) -> bool:
        """Whether none of the lives that admitted this process is in its first step's ``entry``
        (with no record of them: whether it is alone there)."""
        if not self._admitted_by:
            return set(entry) == {self.process_id}
        return not any(entry.get(p) == i for p, i in self._admitted_by.items())

    def _left_without_members(self) -> None:
        """Admitted, but none of the members that admitted this process is in a step it enters
        before its first commit: the run ended (exit 0), or they all died. Then the processes
        of this step (it, and any other joiner admitted with it) start cold: the set-up each put
        off (a checkpoint restore, :meth:`on_cold_start`) runs now, once, so the run goes on from
        the newest checkpoint rather than from a joiner's initial state."""
        deadline = time.monotonic() + 2.0  # members mark the run finished right after its last step
        while time.monotonic() < deadline:
            if self.run_finished():
                _hard_exit(0, f"jaxft: the run finished as process {self.process_id} was admitted; exiting 0")
            time.sleep(0.1)
        logger.warning("process %d: the members that admitted it are gone; going on without them, from its "
                       "put-off set-up (the newest checkpoint, if any)", self.process_id)
        hooks, self._on_cold_start = self._on_cold_start, []
        with self.hang.busy():  # (a restore may take a while)
            for hook in hooks:
                hook()

    def _join(self) -> tuple[list[int], float, bool]:
        """This process's first step: the barrier's process ids, when they were all alive, and
        whether this is a cold start (every process forms the first member set); when a run
        is going on, it waits to be admitted."""
        everyone = sorted({d.process_index for d in jax.devices()})
        if self.run_finished():
            _hard_exit(0, f"jaxft: the run finished before process {self.process_id} could join; exiting 0")
        if self._nobody_runs:  # a cold start: no member list to wait on, whatever the service still holds
            self._nobody_runs = False
            # every earlier life died before this process started, and a death record counts
            # against a life seen alive up to 1 s before it (see _entry_query)
            return everyone, max(time.time(), _STARTED_AT + 1.0), True
        joiner = admission_lib.Joiner(self.process_id, self.timeouts)
        listed_since = time.monotonic()
        while True:
            running = joiner.running_members(settle_s=max(1.5, 0.5 * self.timeouts.heartbeat))
            if running is None:
                return everyone, time.time(), True
            if self.process_id not in running:
                break
            # Still listed: the members have not yet entered a step without this process's
            # previous life (they will at their next step, once they saw it die).
            if time.monotonic() - listed_since > self.timeouts.admission:
                raise BarrierTimeout(f"process {self.process_id}: the running members still list its "
                                     f"previous life after {self.timeouts.describe('admission')}")
            time.sleep(0.2)
        expected = tuple(sorted(set(running) | {self.process_id}))
        with self.hang.busy():  # a compile may take a while; nobody waits for this process yet
            for hook, may_raise in self._before_announce:
                if may_raise:  # (a check: a joiner it refuses must never be admitted)
                    hook(expected)
                    continue
                try:
                    hook(expected)
                except Exception:
                    logger.exception("process %d: set-up before admission failed", self.process_id)
        joiner.announce()
        t0 = time.monotonic()
        with self._watch("waiting to be admitted"):  # exits 0 if the run finishes meanwhile
            admitted = joiner.wait_admitted(members_gone_s=self.timeouts.heartbeat + 2.0)
        if admitted is None:  # every member died meanwhile: start with the others' restarts
            logger.warning("process %d: the members stopped while it waited to be admitted; starting cold",
                           self.process_id)
            return everyone, time.time(), True
        pids, alive_at, self._admitted_by = admitted
        self._step.joining = True
        logger.info("process %d admitted after %.2f s with %s", self.process_id, time.monotonic() - t0, pids)
        return pids, alive_at, False

    def votes(self, members: Members) -> np.ndarray:
        """This member's view of the ready joiners (int32 per process id), to be reduced with
        max across the members inside the step (the result is :meth:`admit`'s argument)."""
        import numpy as np

        if self.admission != "ready":
            return np.zeros(jax.process_count(), np.int32)
        if self._watcher is None:
            self._watcher = admission_lib.ReadyWatcher(jax.process_count())
        return self._watcher.votes(members.process_ids)

    def admit(self, members: Members, agreed_votes) -> tuple[int, ...]:
        """After a commit: the joiners every member agreed on enter at the next step."""
        if self.admission != "ready":
            return ()
        joiners = tuple(p for p, v in enumerate(agreed_votes)
                        if v == admission_lib.READY and p not in members.process_ids)
        if joiners:
            self._step.admit(joiners)
            self._admitted_at = time.monotonic()
            if self._deaths is not None:
                # a joiner is a new life (it connected >= heartbeat + 1.5 s after any earlier
                # death of its process id): earlier death records must not count against it
                self._deaths.assume_alive_since(joiners, time.time() - 1.0)
            assert self._watcher is not None
            self._watcher.admit(joiners, sorted(set(members.process_ids) | set(joiners)), members.incarnations)
        return joiners

    # -- runs and bounded waiting -----------------------------------------------------
    def begin_run(self, target: int) -> RunInfo:
        """Begin this process's next ``run()``, to step ``target`` (see :mod:`jaxft.worker.runs`)."""
        self.run_index += 1
        self.target = target
        state = runs_core.state(self.run_index, target, runs_lib.marks())
        if state == runs_core.RUNNING:
            runs_lib.begin(self.run_index)
        return RunInfo(self.run_index, finished=state == runs_core.FINISHED, passed=state == runs_core.PASSED)

    def finish(self, step: int | None = None) -> None:
        """Tell late joiners this run is over (at ``step``), so none waits for peers that are gone.
        The ready watcher stops until the next run's first step (a later ``run()`` admits again)."""
        self.hang.finished()
        self._report_old_backends()
        if runs_core.state(self.run_index, self.target, runs_lib.marks()) != runs_core.PASSED:
            runs_lib.end(self.run_index, step)  # (a run the members passed keeps their mark)
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    def exit_if_finished_before_joining(self) -> None:
        """After a failed step, in a life that has committed none: if peers finished the run
        meanwhile, exit 0 (a cold start that waited out a barrier for members that were
        finishing then went on alone and trained a second copy of the run, in a chaos run)."""
        if self._step.agreed is None and self.run_finished():
            _hard_exit(0, f"jaxft: the run finished before process {self.process_id} committed a step; exiting 0")

    def run_finished(self) -> bool:
        """Whether peers finished the run this process is in, and nothing runs after it
        (:mod:`jaxft.worker.runs`; a later ``run()`` in progress is not an end: this process catches up)."""
        return runs_core.state(self.run_index, self.target, runs_lib.marks()) == runs_core.FINISHED

    @contextlib.contextmanager
    def _watch(self, what: str, publish: bool = False) -> Iterator[None]:
        """Arm the watchdog for the duration of one barrier; ``publish``: say at once that this
        process waits (the exit of a failed step: a member stuck in it leaves once it sees that,
        see jaxft.worker.hang), not only after ``WAIT_NOTICE_S``."""
        if self._watchdog is None:
            self._watchdog = _Watchdog(self)
        self.hang.phase("at a barrier")
        if publish:
            self.hang.waiting(what)
        self._watchdog.arm(what, publish)
        try:
            yield
        finally:
            if self._watchdog.disarm():
                self.hang.done_waiting()

    def _enter(self, devices: Sequence[jax.Device], live_map: Mapping[jax.Device, int]) -> Members:
        current = _member_map({d: live_map[d] for d in devices})
        previous = self._previous
        joined = tuple(sorted(p for p, i in current.items() if previous is not None and previous.get(p) != i))
        left = tuple(sorted(p for p in (previous or {}) if p not in current))
        if previous != current:
            self.generation += 1
        gained = is_new(self._step.agreed, current)
        key = tuple(sorted(current))
        reset = self.needs_data_plane_reset and (is_new(self._synced, current) or key in self._suspect)
        if reset:
            self._reset_data_plane(current)
            devices = [d for d in jax.devices() if d.process_index in current]
        else:
            if self._synced is None:
                self._synced = dict(current)
            if self.needs_data_plane_reset and key not in self._used:
                self.hang.long_step()  # (compiles the rendezvous program)
                rendezvous.compile_for(devices)()
        self._used.add(key)
        self._previous = dict(current)
        devices = tuple(sorted(devices, key=lambda d: d.id))
        mesh_is_new = tuple(d.id for d in devices) not in self._meshes
        return Members(devices=devices, mesh=self.mesh(devices),
                       process_ids=tuple(sorted(current)), incarnations=current,
                       generation=self.generation, joined=joined, left=left, reset=reset,
                       gained=gained, mesh_is_new=mesh_is_new)

    def _reset_data_plane(self, current: Mapping[int, int]) -> None:
        """Agree, clear stale rendezvous keys, barrier, rebuild the CPU backend."""
        self.hang.long_step()  # waits for every member, then recompiles: Timeouts.setup bounds it
        digest = _map_digest(current)
        attempt = self._reset_attempts.get(digest, 0)
        self._reset_attempts[digest] = attempt + 1
        members = sorted(current)
        namespace = f"jaxft/reset/{digest}-{attempt}"
        if self.process_id == members[0]:
            _compat.delete_stale_cpu_keys(kv.client(), topology=False)
            if self._last_reset_ns is not None:  # every member passed it before this reset began
                kv.delete_dir(self._last_reset_ns)
        self._last_reset_ns = namespace
        # Two barriers that give up on a member whose life in ``current`` is over (the launcher
        # recorded its exit, it restarted, or its heartbeat stopped: jaxft.worker.lives; in either
        # admission mode, also when it died before reaching them): before the rebuild, and
        # after it, right before the new backend's gloo
        # rendezvous (jaxft.worker.rendezvous: compiled before the barrier, run right after it). A
        # member that dies between the second barrier and publishing its rendezvous key is
        # waited for 30 s (gloo's own bound; see docs/design.md): that window is now microseconds
        # instead of everything the step did before its first collective.
        cancel = threading.Event()
        barrier = kv.KVBarrier(namespace, members, self.process_id, cancel, timeouts=self.timeouts, what="reset",
                               dead_after="save_dead_after", unknown_after="reset", timeout_name="reset",
                               lives=current)
        t0 = time.monotonic()
        with self._deaths_cancel(cancel, members):
            barrier(key="rebuild", timeout_ms=int(self.timeouts.reset * 1000))
            t1 = time.monotonic()
            for hook in self._pre_reset:
                hook()
            self._meshes.clear()
            self._used.clear()
            self._suspect.clear()
            self._old_backends.append((weakref.ref(jax.devices()[0].client), time.monotonic()))
            if self.process_id == 0:
                # Process 0's new backend writes the global topology again (the old copy would
                # fail it with ALREADY_EXISTS): delete that copy only now, past the barrier. A
                # process starting its backend meanwhile waits for the key; deleted before the
                # barrier, while a rebuild that failed on a death left it unwritten, a restarted
                # process waited in its start-up for it, and the members waited for that process
                # at their next step (until the 2 min topology timeout: 180 s test runs).
                _compat.delete_global_topology_key(kv.client())
            jax_backend.clear_backends()
            jax.devices()  # rebuild now, inside the step
            t2 = time.monotonic()
            for hook in self._post_reset:
                hook()
            self._synced = dict(current)
            connect_gloo = rendezvous.compile_for([d for d in jax.devices() if d.process_index in current])
            barrier(key="rebuilt", timeout_ms=int(self.timeouts.reset * 1000))
            connect_gloo()
        self.last_reset = {"barrier_s": round(t1 - t0, 4), "backend_s": round(t2 - t1, 4),
                           "state_s": round(time.monotonic() - t2, 4)}
        logger.info("process %d rebuilt the CPU data plane for %s: %s", self.process_id, members, self.last_reset)


class _Watchdog:
    """One daemon thread that bounds every barrier wait of an :class:`ElasticGroup`.

    While armed it checks, every ``poll_s``, whether the peers finished the run (exit 0)
    or the wait outlasted ``barrier_timeout_s`` (exit :data:`EXIT_BARRIER_TIMEOUT`). It is
    one long-lived thread, so arming it costs a lock, not a thread start, on every step.
    """

    def __init__(self, group: ElasticGroup):
        self.group = group
        self._cond = threading.Condition()
        self._armed: tuple[str, float] | None = None
        self._published = False  # this wait was published (jaxft.worker.hang) and must be cleared
        threading.Thread(target=self._run, daemon=True, name="jaxft-watchdog").start()

    def arm(self, what: str, published: bool = False) -> None:
        """Watch the wait ``what``; ``published``: the caller published it already (jaxft.worker.hang)."""
        with self._cond:
            self._armed = (what, time.monotonic())
            self._published = published
            self._cond.notify()

    def disarm(self) -> bool:
        """Stop watching; True if this wait was long enough to be published (see jaxft.worker.hang)."""
        with self._cond:
            self._armed = None
            published, self._published = self._published, False
            return published

    def _run(self) -> None:
        g = self.group
        while True:
            with self._cond:
                while self._armed is None:
                    self._cond.wait()
                armed = self._armed
                self._cond.wait(g.poll_s)
                if self._armed is not armed:
                    continue  # disarmed (or re-armed) in time
            what, t0 = armed
            if not self._published and time.monotonic() - t0 > WAIT_NOTICE_S:
                g.hang.waiting(what)  # a member may be hung: let it know we wait for it
                with self._cond:
                    self._published = self._armed is armed
                    if not self._published:
                        g.hang.done_waiting()
            if g.run_finished():
                _hard_exit(0, f"jaxft: peers finished the run while process {g.process_id} was {what}; "
                              "exiting 0")
            if time.monotonic() - t0 > g.barrier_timeout_s:
                _hard_exit(EXIT_BARRIER_TIMEOUT,
                           f"jaxft: process {g.process_id} waited {g.barrier_timeout_s:.0f} s while {what} "
                           f"(a peer is alive but stuck?), the bound {g.timeouts.describe('barrier')}; exiting")


def _held_arrays(client) -> list[str]:
    """``dtype[shape]`` of each array of ``client`` that is still alive (none if ``client`` is gone)."""
    if client is None:
        return []
    try:
        return sorted({f"{a.dtype}{list(a.shape)}" for a in client.live_arrays()})
    except Exception:  # noqa: BLE001 - a client that cannot list them holds none we can name
        return []


def _hard_exit(code: int, message: str) -> None:
    """Log ``message`` and leave now (a thread cannot unwind the main thread's barrier wait)."""
    (logger.info if code == 0 else logger.error)(message)
    for handler in [*logging.getLogger().handlers, *logger.handlers, logging.lastResort]:
        if handler is not None:
            handler.flush()
    os._exit(code)

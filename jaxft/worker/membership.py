"""The agreed live set and the atomic step, built on ``live_devices``.

``jax.experimental.multihost_utils.live_devices`` gives every live process the same set
of devices and makes its block commit everywhere or fail everywhere. :class:`ElasticGroup`
wraps it so users never meet its rough edges:

* members are reported per process (ids and coordination-service incarnations), with a
  generation number and who joined or left since the previous step;
* on CPU, when the set gains a member, the gloo data plane is rebuilt before the step body
  runs (:mod:`jaxft.worker.dataplane`), so a restarted process can take part again;
* a restarted process sets up while the members train and enters at a step boundary they
  agree on (ready admission, :mod:`jaxft.worker.joining`);
* every barrier wait is bounded (:mod:`jaxft.worker.watchdog`);
* a failed step surfaces as :class:`StepFailed` naming the failed processes; any other
  exception propagates unchanged.

The decisions of the step (what to query at entry, commit or fail) are
:class:`jaxft.core.commit.MemberStep`'s; this module carries them out.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxft import _compat, priority, protocol
from jaxft import timeouts as timeouts_lib
from jaxft.core import commit as commit_core
from jaxft.core.rejoin import is_new
from jaxft.errors import StepFailed
from jaxft.timeouts import Timeouts
from jaxft.worker import admission as admission_lib
from jaxft.worker import deaths as deaths_lib
from jaxft.worker import kv, lives
from jaxft.worker import runs as runs_lib
from jaxft.worker.dataplane import DataPlane
from jaxft.worker.hang import HangMonitor
from jaxft.worker.joining import Joining
from jaxft.worker.members import Members
from jaxft.worker.runs import RunInfo
from jaxft.worker.watchdog import Watchdog, hard_exit

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["ElasticGroup", "Members", "StepFailed"]


def _leave_inside_step(cm: contextlib.AbstractContextManager, e: BaseException) -> None:
    """Make the exit query of the ``live_devices`` step ``cm`` that ``e`` (SystemExit,
    KeyboardInterrupt) leaves, now, while the client is up (the caller bounds it).

    Left suspended, the generator would make it when collected at exit, where a peer that left
    meanwhile turns it into an ignored ``ProcessFailureError`` traceback in the output."""
    try:
        cm.__exit__(type(e), e, e.__traceback__)
    except Exception as left:  # noqa: BLE001 - leaving anyway: who else left is moot
        logger.debug("leaving inside a step: %s", left)


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
    at a step boundary they all agree on (:mod:`jaxft.worker.joining`; the step must carry the
    votes, which :class:`~jaxft.ElasticLoop` and :class:`~jaxft.ElasticTrainer` do).
    ``"connect"``: it is a member as soon as ``jaxft.initialize()`` connects, and the members
    wait for its set-up at their next step. ``None`` (default): ready under an
    ``ElasticLoop``/``ElasticTrainer``, connect for a bare ``group.step()`` loop like the one
    above (nothing there carries votes, so a ready joiner would never enter). Every wait is
    bounded by ``timeouts`` (None: :func:`jaxft.timeouts.current`).
    """

    def __init__(self, axis_name: str = "data", *, admission: str | None = None, timeouts: Timeouts | None = None,
                 poll_s: float = 0.5):
        if admission not in (None, "connect", "ready"):
            raise ValueError(f"admission must be 'connect', 'ready' or None, got {admission!r}")
        self.admission, self.axis_name = admission, axis_name
        self.timeouts = timeouts or timeouts_lib.current()
        self.process_id = jax.process_index()
        self.generation, self.runs = 0, runs_lib.Runs()
        self.deferred = 0  # steps whose exit query was left to a later step's (see defer_commit)
        self.life: lives.Life | None = None  # this process's registered life (jaxft.worker.lives)
        # jaxft launch's word on a restart: a member may run on (True), none does (False: every
        # local worker died in the same failure, one node), or nothing said (None)
        self.peers_may_run: bool | None = protocol.peers_may_run(os.environ)
        self.hang = HangMonitor(self.process_id, self.timeouts, poll_s=poll_s)
        self._step = commit_core.MemberStep()  # the step protocol's state (ready admission; jaxft.core.commit)
        self._watchdog = Watchdog(self.process_id, self.timeouts, self.hang, self.run_finished, poll_s)
        self.data_plane = DataPlane(self.process_id, axis_name, self.timeouts, self.hang)
        self._joining = Joining(self.process_id, self.timeouts, self.hang, self._step, self._watchdog.watch,
                                self.run_finished, self.peers_may_run is False, protocol.spares(os.environ))
        self.width = self._joining.width  # the members a run with hot spares trains with (None: no spares)
        self._before_exit_query: Callable[[], None] | None = None  # (the loop's in-commit fault point)
        self._marked_commit = False  # this life's first commit is marked for its launcher
        self._published: tuple[int, ...] | None = None
        self._deaths: deaths_lib.DeathWatch | None = None
        self._defer = False  # the step in progress leaves its commit to the next step's query (defer_commit)
        self._previous: dict[int, int] | None = None  # member map of the previous step

    # -- hooks ------------------------------------------------------------------------
    def on_reset(self, before: Callable[[], None] | None = None, after: Callable[[], None] | None = None,
                 during: Callable[[], None] | None = None) -> None:
        """Callbacks around a data-plane rebuild, and inside any sync (:meth:`DataPlane.on_reset`)."""
        self.data_plane.on_reset(before, after, during)

    def before_admission(self, hook: Callable[[tuple[int, ...]], None], may_raise: bool = False,
                         announced: bool = False, spare: bool = False) -> None:
        """Register ``hook(process_ids)``, run by a joiner (ready admission) with the member set it
        expects to enter, before it says it is ready (``announced``: right after): set-up there
        costs the members nothing. Errors are logged and ignored, unless ``may_raise`` (a check
        that must stop it; run first). A hot spare runs the checks, then only ``spare`` hooks."""
        self._joining.before_admission(hook, may_raise, announced, spare)

    def on_cold_start(self, hook: Callable[[], None]) -> None:
        """Register ``hook()``, run once if this process's first step (ready admission) is a cold
        start rather than an admission: set-up only a cold start needs (a checkpoint restore,
        which an admitted process would throw away for a member's state), put off until then."""
        self._joining.on_cold_start(hook)

    def on_exit_query(self, hook: Callable[[], None]) -> None:
        """Register ``hook()``, run right before each step's exit query (the ``in-commit`` fault point)."""
        self._before_exit_query = hook

    def members_listed(self) -> bool:
        """Whether the members of a running job have published their list (one key-value
        read). A stale list, of members that all died, is told apart from a live one only at
        this process's first step: set-up put off on this answer registers :meth:`on_cold_start`."""
        return admission_lib.Joiner(self.process_id, self.timeouts).listed_members() is not None

    def busy(self):
        """Context manager: long work between steps (an evaluation some run), exempt from the step deadline."""
        return self.hang.busy()

    def mesh(self, devices: Sequence[jax.Device]) -> Mesh:
        """A cached 1-D mesh over ``devices``."""
        return self.data_plane.mesh(devices)

    @property
    def joining(self) -> bool:
        """Admitted into a running set (ready admission), until this process's first commit."""
        return self._step.joining

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
        step = self._ready_step() if self.admission == "ready" else self._connect_step()
        with step as members:
            yield members

    @contextlib.contextmanager
    def _connect_step(self) -> Iterator[Members]:
        """The step of connect admission: ``live_devices`` as it is."""
        priority.restore()  # a restart set up niced (see jaxft.priority): it is a member from now on
        cm = multihost_utils.live_devices(jax.devices())
        members: Members | None = None
        watch = self._watchdog.watch
        try:
            with watch("entering a step"):
                devices = cm.__enter__()
            try:
                members = self._enter(devices, _compat.live_device_map())
                yield members
            except Exception as e:
                self.data_plane.break_if_collective_failed(e)
                with watch("leaving a failed step", publish=True):
                    if not cm.__exit__(type(e), e, e.__traceback__):
                        raise
            except BaseException as e:  # SystemExit, KeyboardInterrupt: leaving, not a failed step
                with watch("leaving the run inside a step"):
                    _leave_inside_step(cm, e)
                raise
            else:
                with watch("leaving a step"):
                    cm.__exit__(None, None, None)
                self._step.agreed = dict(members.incarnations)
                self._mark_committed()
        except multihost_utils.ProcessFailureError as e:
            if members is not None:
                self.data_plane.taint()
            raise StepFailed({d.process_index for d in e.failed_devices}, e.__cause__) from e
        finally:
            self.hang.phase("between steps")
            _compat.rekey_live_devices(jax.devices())

    def defer_commit(self) -> None:
        """Inside a :meth:`step` (ready admission) whose body succeeded: leave this step's
        exit query to the next step's, which then commits both or neither.

        What makes it safe: every member of the step decides alike (the caller's decision
        must rest on what the members share, see ``LoopOptions.commit_every``), and a member
        whose body fails makes its query anyway: the others' next step meets it there, as
        their next collective fails without it, so every member still makes the same
        sequence of liveness queries (the service matches them by process set).
        """
        if self.admission != "ready":
            raise ValueError("defer_commit needs ready admission (its steps skip the liveness query at entry)")
        self._defer = True

    @contextlib.contextmanager
    def _ready_step(self) -> Iterator[Members]:
        """The step of ready admission: ``live_devices``' protocol on ``get_live_nodes``, with a
        query at entry only when needed, and the exit query over the entry's live set.

        In steady state a step costs one round trip: the exit query of step k (the commit) is
        the entry set of step k+1. An entry query is made on the first step, after a failed
        step, and when joiners were admitted (it is where they meet the members). The exit
        query runs over the processes that entered, so a restarted life of a process that was
        left out is never pulled into the members' barrier before it is ready.
        """
        client, plan = kv.client(), self._step.plan_entry()
        if self._deaths is None:
            self._deaths = deaths_lib.DeathWatch()
        if isinstance(plan, commit_core.UseCommitted):
            entry = dict(plan.entry)  # the last commit's live set: no round trip
        else:
            life = self.life.incarnation if self.life else None
            entry = self._joining.entry_query(client, plan, self._deaths, life, last_entry=self._previous)
        if self._published != tuple(sorted(entry)):
            # every member got the same entry answer: each tells joiners who runs, with its own
            # heartbeat (one write per member when the members change, none in steady state)
            self._published = tuple(sorted(entry))
            admission_lib.publish_members(entry, self.process_id)
        self._joining.check_entry(entry)  # (until its first commit)
        self._step.entered(entry)  # (nothing committed until it exits)
        self._deaths.saw(entry)
        live_map = {d: entry[d.process_index] for d in jax.devices() if d.process_index in entry}
        error: BaseException | None = None
        members: Members | None = None
        tripwire = self.data_plane.tripwire(entry, self._deaths)
        try:
            members = self._enter(list(live_map), live_map)
            if tripwire is not None:
                tripwire.arm([p for p in entry if p != self.process_id])
            yield members
        except BaseException as e:  # noqa: BLE001 - re-raised below unless a member failed
            error = e
            self.data_plane.break_if_collective_failed(e)
        finally:
            if tripwire is not None:
                tripwire.disarm()
        defer, self._defer = self._defer, False
        if (error is not None and not isinstance(error, Exception)) or (defer and error is None):
            self.hang.phase("between steps")
            if error is not None:
                raise error  # SystemExit (the SIGTERM handler's), KeyboardInterrupt: leaving
            self.deferred += 1  # the next step's query commits this one too (defer_commit)
            self._step.defer(entry)
            return
        try:
            with self._watchdog.watch("leaving a failed step" if error is not None else "leaving a step",
                                      publish=error is not None):
                if self._before_exit_query is not None:
                    self._before_exit_query()
                exit_ = self._deaths.live_nodes(client.get_live_nodes, sorted(entry), lives=entry)
        finally:
            self.hang.phase("between steps")
        outcome = self._step.exited(entry, exit_, body_ok=error is None)
        if outcome is commit_core.Outcome.FAIL:
            if members is not None:
                self.data_plane.taint()
            raise StepFailed(set(commit_core.failed_members(entry, exit_)), error, self._deaths.noticed) from error
        if outcome is commit_core.Outcome.ERROR:
            assert error is not None
            raise error
        self._joining.committed()
        self._mark_committed()

    def _enter(self, devices: Sequence[jax.Device], live_map: Mapping[jax.Device, int]) -> Members:
        self.hang.step_started()
        current = {d.process_index: int(live_map[d]) for d in devices}
        previous = self._previous
        joined = tuple(sorted(p for p, i in current.items() if previous is not None and previous.get(p) != i))
        left = tuple(sorted(p for p in (previous or {}) if p not in current))
        if previous != current:
            self.generation += 1
        gained = is_new(self._step.agreed, current)
        ordered, reset, mesh_is_new = self.data_plane.enter(devices, current, self._deaths)
        self._previous = dict(current)
        if reset or gained or mesh_is_new:
            self.hang.long_step()  # a compile or a rejoin: bounded by Timeouts.setup
        return Members(mesh=self.mesh(ordered), incarnations=current, generation=self.generation, joined=joined,
                       left=left, reset=reset, gained=gained, mesh_is_new=mesh_is_new)

    def _mark_committed(self) -> None:
        """Once per life, mark its first commit for the launcher's crash-loop guard (a life that
        committed is never taken for a set-up that crashes alike, :mod:`jaxft.supervisor.crashloop`)."""
        if not self._marked_commit:
            self._marked_commit = True
            protocol.mark_life(protocol.COMMITTED, "this life's first commit")

    # -- admission votes (admission="ready") ------------------------------------------
    def votes(self, members: Members) -> np.ndarray:
        """This member's view of the ready joiners (int32 per process id), to be reduced with
        max across the members inside the step (the result is :meth:`admit`'s argument)."""
        import numpy as np

        if self.admission != "ready":
            return np.zeros(jax.process_count(), np.int32)
        return self._joining.votes(members.process_ids, self._deaths)

    def admit(self, members: Members, agreed_votes) -> tuple[int, ...]:
        """After a commit: the joiners every member agreed on enter at the next step."""
        if self.admission != "ready":
            return ()
        return self._joining.admit(members.process_ids, members.incarnations, agreed_votes, self._deaths)

    def spares_after_failure(self, entry: Mapping[int, int], hold: bool) -> tuple[int, ...]:
        """After a step over ``entry`` failed: the spares its survivors take in at once (``Joining.after_failure``)."""
        return self._joining.after_failure(entry, self._step.barrier, hold, self._deaths, self.admission == "ready")

    # -- runs -------------------------------------------------------------------------
    @property
    def target(self) -> int | None:
        """The step the current ``run()`` trains to."""
        return self.runs.target

    def begin_run(self, target: int) -> RunInfo:
        """Begin this process's next ``run()``, to step ``target`` (see :mod:`jaxft.worker.runs`)."""
        return self.runs.begin_run(target)

    def finish(self, step: int | None = None) -> None:
        """Tell late joiners this run is over (at ``step``), so none waits for peers that are gone.
        The ready watcher stops until the next run's first step (a later ``run()`` admits again)."""
        self.hang.finished()
        self.data_plane.report_old_backends()
        self.runs.finish(step)
        self._joining.stop_watching()

    def exit_if_finished_before_joining(self) -> None:
        """After a failed step, in a life that has committed none: if peers finished the run
        meanwhile, exit 0 (a cold start that waited out a barrier for members that were
        finishing then went on alone and trained a second copy of the run, in a chaos run)."""
        if self._step.agreed is None and self.run_finished():
            hard_exit(0, f"jaxft: the run finished before process {self.process_id} committed a step; exiting 0")

    def run_finished(self) -> bool:
        """Whether peers finished the run this process is in (:meth:`jaxft.worker.runs.Runs.finished`)."""
        return self.runs.finished()

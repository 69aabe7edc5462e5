"""Compile the likely next step programs in the background, before a failure needs them.

When a member dies, the survivors retry the step on a smaller mesh, whose program must be
compiled (or loaded from the persistent cache) first: on CPU that compile was most of what a
failure cost them. The likely next meshes are known in advance:
the current members less any one of them (then those less a member and its successor, see
:func:`shrinks`). :class:`Warmer` lowers and compiles the step for each of those in one daemon
thread of process 0 after the members change. jax writes persistent-cache entries from process
0 only, and process 0 can compile for devices it does not hold, so every entry one failure away
is on disk before the failure: the survivors load the executable, a fraction of a compile's
time, and process 0, if it survives, finds it in memory (a jitted function called with the
arguments it was lowered for reuses the ahead-of-time compile). Only process 0 does the work:
when every member compiled its own candidates, their compiles on shared cores slowed the steps
after each change by more than the retries saved (measured: docs/benchmarks.md, 'Figures
behind the code'). The steps are opt-in (``LoopOptions(precompile=K)``, or spares waiting); the
tiny programs on a failure's way back (a new device list's gloo rendezvous, a rejoin's
agreement) are compiled ahead always: milliseconds each in the background, against the same
compile in every member on the way back.

Safety: the thread never runs while the backend is rebuilt (:meth:`Warmer.pause` takes its
lock, waiting for at most the compile in progress), and work queued for an older backend is
dropped. A failed warm-up is only logged: the step compiles as before when it needs to.
"""

from __future__ import annotations

import atexit
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxft.protocol import Event
from jaxft.worker import rejoin, rendezvous, transfer
from jaxft.worker.arrays import shapes
from jaxft.worker.programs import mesh_of

logger = logging.getLogger(__name__)

Job = Callable[[], object]  # lowers and compiles one program (what it returns is dropped)
LOAD_WAIT_S = 30.0  # how long a process loading ahead waits for process 0's compile of a program


class Warmer:
    """One daemon thread running compile jobs, one at a time, for the current backend."""

    def __init__(self, on_done: Callable[[object, float], None] | None = None) -> None:
        self._lock = threading.Lock()  # held while a job runs, and while the backend is rebuilt
        self._queue: queue.Queue[tuple[int, object, Job]] = queue.Queue()
        self._epoch = 0  # bumped at every backend rebuild: older jobs are dropped
        self._queued: set[object] = set()
        self.on_done = on_done  # called in the worker thread after each job
        threading.Thread(target=self._run, daemon=True, name="jaxft-warmup").start()
        atexit.register(self.close)

    def submit(self, key: object, job: Job) -> None:
        """Run ``job`` in the background unless ``key`` was queued since the last rebuild."""
        if key in self._queued:  # called from the step loop's thread only, like pause()
            return
        self._queued.add(key)
        self._queue.put((self._epoch, key, job))

    @property
    def epoch(self) -> int:
        """Bumped at every rebuild and at exit: a job can tell it should stop."""
        return self._epoch

    def pause(self) -> None:
        """Before a backend rebuild: drop the queued jobs (they were for the old backend), then
        wait for the job in progress, if any; no job runs until :meth:`resume`."""
        self._epoch += 1  # first: the worker drops every queued job from now on
        self._queued.clear()
        self._lock.acquire()

    def resume(self) -> None:
        """After the rebuild: jobs submitted from now on run."""
        self._lock.release()

    def close(self, timeout_s: float = 60.0) -> None:
        """At exit: drop the queued jobs and wait (bounded) for the one in progress; no job runs
        after. A daemon thread still inside XLA's compiler when the interpreter ends is unwound
        through C++ that does not let it pass, and the process aborts ("terminate called after
        throwing an instance of ''", "FATAL: exception not rethrown") after its run finished."""
        self._epoch += 1
        self._queued.clear()
        self._lock.acquire(timeout=timeout_s)  # (held for good; not if a rebuild holds it: bounded)

    def _run(self) -> None:
        while True:  # (one call per job: nothing of it stays referenced while the next is awaited,
            self._one(*self._queue.get())  # e.g. a mesh of a backend a rebuild replaced)

    def _one(self, epoch: int, key: object, job: Job) -> None:
        with self._lock:
            if epoch != self._epoch:
                return
            t0 = time.monotonic()
            try:
                job()
            except Exception as e:  # noqa: BLE001 - the step compiles itself when needed
                logger.info("background compile of %s failed: %s", key, str(e).splitlines()[0][:200])
                return
            seconds = time.monotonic() - t0
            logger.info("compiled %s in the background in %.2f s", key, seconds)
            if self.on_done is not None:
                self.on_done(key, seconds)


def shrinks(members: Sequence[int], min_members: int = 1) -> list[tuple[int, ...]]:
    """The member sets a failure away from ``members``: less one process (the highest first),
    then less a process and its successor too (cyclically: when a member dies inside gloo's
    ring all-reduce, its successor is the survivor gloo may leave in a pending send or abort,
    see :mod:`jaxft.worker.runner`); none below ``min_members``. The single failures come first: since
    a member left in a doomed step's program leaves the program instead of the run
    (:mod:`jaxft.worker.runner`), the retry after a kill is almost always the set less the dead one."""
    members = sorted(members)
    n = len(members)
    if n - 1 < max(1, min_members):
        return []
    singles = [tuple(p for p in members if p != members[i]) for i in reversed(range(n))]
    if n - 2 < max(1, min_members):
        return singles
    pairs = [tuple(p for p in members if p not in {members[i], members[(i + 1) % n]}) for i in reversed(range(n))]
    return singles + pairs


def swaps(members: Sequence[int], spares: Sequence[int]) -> list[tuple[int, ...]]:
    """The member sets a failure away from ``members`` when a spare takes the dead one's place
    (:mod:`jaxft.core.spares`): less one process (the highest first), plus one of ``spares``."""
    members = sorted(members)
    return [tuple(sorted(set(members) - {gone} | {s})) for gone in reversed(members) for s in sorted(spares)]


class Precompiler:
    """One loop's warm-up (``LoopOptions(precompile=K)``) and a joiner's compile before admission.

    Process 0, after a commit on a member set it did not warm up for yet, compiles in the
    background the step for each set one failure away (same state and batch shapes, another
    mesh) with the gloo rendezvous a new device list runs first, and, while someone is missing,
    the rejoin's agreement (and, with ``precompile``, its transfer from the donor it will have).
    Without ``precompile``, on CPU, with every process a member, the step of one set one death
    away is compiled all the same: every other set of that width loads it, reassigned to its
    devices (:mod:`jaxft.worker.executables`), where the first death of a run otherwise compiled
    it while the survivors waited (~1.4 s on two cores). Not at a narrower width: there it was
    a compile of 1.3-2.1 s beside the steps for a second death that rarely comes before the
    restart is back (docs/benchmarks.md, session 36).
    With spares at full width, the sets one failure away are first the swaps (:func:`swaps`),
    each with the spare's agreement and transfer: every program a swap runs is in jax's
    persistent cache before it."""

    def __init__(self, programs: Any, feeder: Any, group: Any, events: Any, precompile: int, min_members: int):
        self.programs, self.feeder, self.group, self.events = programs, feeder, group, events
        self.precompile, self.min_members = precompile, min_members
        self._warmer: Warmer | None = None
        self._warmed_for: tuple[int, ...] | None = None  # the member set the last warm-up was for
        self._done: set[tuple] = set()  # what was compiled ahead in this life
        self._loads = 0  # calls of _load_ahead

    def after_commit(self, process_ids: tuple[int, ...], state: Any) -> None:
        """Warm up for ``process_ids`` (the members of the commit) if this process should. Always
        (several processes) the tiny programs of a failure's way back, whatever the model: on
        CPU the gloo rendezvous of each set one death away, and while someone is missing the
        rejoin's rendezvous and agreement, compiles of milliseconds each. The steps and the
        rejoin's transfer with ``precompile``; with spares waiting their swaps (each with its
        agreement and transfer), whatever ``precompile`` says."""
        width = self.group.width
        shrinking = bool(self.precompile) and len(process_ids) <= self.precompile
        swapping = width is not None and len(process_ids) >= width
        if jax.process_count() < 2 or self.feeder.template is None or self._warmed_for == process_ids:
            return
        self._warmed_for = process_ids
        state_shapes, template, axis = shapes(state), self.feeder.template, self.group.axis_name
        everyone = tuple(range(jax.process_count()))
        spares = [p for p in everyone if p not in process_ids] if swapping else []
        me = self.group.process_id
        if me != 0:  # process 0 compiles them; the others load what they would run of them
            self._load_ahead([pids for pids in swaps(process_ids, spares) if me in pids], state)
            return
        warmer = self._background()
        nbytes = transfer.tree_nbytes({"step": np.int64(0), "state": state})
        def then(what: str, pids: tuple[int, ...], job: Job) -> None:
            if (what, pids) not in self._done:  # on disk already: after a rebuild it loads from there
                warmer.submit((what, pids), job)

        def step_for(pids: tuple[int, ...]) -> None:
            then("step", pids, functools.partial(self.programs.compile_for, mesh_of(pids, axis), state_shapes,
                                                 template))

        def connect_for(pids: tuple[int, ...]) -> None:  # gloo's rendezvous of a new device list (CPU only)
            if self.group.data_plane.needs_reset and len(pids) > 1:  # (one process has none)
                then("rendezvous", pids, lambda: rendezvous.compile_for(list(mesh_of(pids, axis).devices.flat)))

        def joining(pids: tuple[int, ...], donor: int) -> None:  # the agreement, then the transfer
            then("agree", pids, lambda: rejoin.compile_agree(mesh_of(pids, axis)))
            if shrinking or swapping:  # (its compile grows with the state's chunks: opt-in)
                then("rehydrate", pids, lambda: transfer.compile_broadcast(nbytes, donor, mesh_of(pids, axis), axis))

        for pids in swaps(process_ids, spares):  # each with the spare's entry, from the donor it will have
            step_for(pids)
            connect_for(pids)
            joining(pids, min(p for p in pids if p in process_ids))
        one_death = shrinks(process_ids, self.min_members)[:1]
        for pids in shrinks(process_ids, self.min_members):
            if shrinking:
                step_for(pids)
            if shrinking or len(pids) == len(process_ids) - 1:  # (by default the single deaths only)
                connect_for(pids)
        if (not shrinking and not swapping and one_death and len(process_ids) == jax.process_count()
                and self.group.data_plane.platform == "cpu"):  # (at full width: a narrower one is rarer)
            step_for(one_death[0])  # one is enough on CPU: the others of its width load it, reassigned
        if not spares and process_ids != everyone:
            # someone is missing: the rejoin, with the donor it will have (the lowest member)
            connect_for(everyone)
            joining(everyone, min(process_ids))

    def before_admission(self, pids: tuple[int, ...], step: int, state: Any) -> None:
        """A joiner, before it says it is ready: the step for the members it will enter, so that
        the admission step loads it (:mod:`jaxft.worker.executables`) instead of tracing it."""
        t0 = time.monotonic()
        mesh = mesh_of(pids, self.group.axis_name)
        if self.feeder.template is None:
            self.feeder.host_batch(step, mesh)
        self.programs.compile_for(mesh, shapes(state), self.feeder.template)
        logger.info("process %d compiled the step for %s before admission in %.2f s", self.group.process_id,
                    list(pids), time.monotonic() - t0)

    def as_spare(self, pids: tuple[int, ...], step: int, state: Any) -> None:
        """A hot spare, before it says it is ready: it cannot compile for a member set it does not
        know, but it names the programs the members share (the fingerprint of the reference
        program, :mod:`jaxft.worker.executables`: ~0.2 s of tracing here), which its first step
        after a swap otherwise did while the members waited for it; then, in the background,
        it loads what it would run first in each set a swap away (:meth:`_load_ahead`)."""
        t0 = time.monotonic()
        members = tuple(p for p in pids if p != self.group.process_id)
        if self.feeder.template is None:  # (the global batch's shapes: the same on any mesh)
            self.feeder.host_batch(step, mesh_of(members, self.group.axis_name))
        self.programs.executables.name_shared()
        logger.info("process %d named the shared step programs as a spare in %.2f s", self.group.process_id,
                    time.monotonic() - t0)
        if jax.process_count() > 1:
            self._load_ahead(swaps(members, [self.group.process_id]), state)

    def _load_ahead(self, sets: list[tuple[int, ...]], state: Any) -> None:
        """A process other than 0 (a member, or a spare), with spares waiting: load, in the
        background, what it would run first in each of ``sets`` (the sets a swap away, whose
        programs process 0 compiles): the gloo rendezvous, and the step, waiting for process 0's
        file for at most :data:`LOAD_WAIT_S`. Loading them on the way back took 14-30 ms
        (rendezvous) and 40-75 ms (step) on each such process, while the others waited for it
        (docs/benchmarks.md, session 36)."""
        if not sets:
            return
        warmer, axis = self._background(), self.group.axis_name
        state_shapes, template = shapes(state), self.feeder.template
        self._loads += 1  # (the loads still waiting for an older call's sets give up)
        epoch, loads, deadline = warmer.epoch, self._loads, time.monotonic() + LOAD_WAIT_S

        def stale() -> bool:
            return warmer.epoch != epoch or self._loads != loads or time.monotonic() > deadline

        for pids in sets:
            mesh = mesh_of(pids, axis)
            if self.group.data_plane.needs_reset:
                warmer.submit(("rendezvous", pids), functools.partial(rendezvous.compile_for, list(mesh.devices.flat)))
            warmer.submit(("load", pids, loads), functools.partial(self.programs.preload_for, mesh, state_shapes,
                                                                   template, stale))

    def _background(self) -> Warmer:
        """This process's background thread (started on first use)."""
        if self._warmer is None:
            self._warmer = Warmer(on_done=self._compiled_one if self.group.process_id == 0 else None)
            self.group.on_reset(before=self._pause, after=self._warmer.resume)
        return self._warmer

    def _compiled_one(self, key: Any, seconds: float) -> None:
        self._done.add(key)
        program, pids = key
        self.events.log(Event.PRECOMPILED, program=program, members=list(pids), seconds=round(seconds, 3))

    def _pause(self) -> None:
        """Before a backend rebuild: no compile runs across it, and the next commit warms up anew."""
        assert self._warmer is not None
        self._warmer.pause()
        self._warmed_for = None

"""The CPU data plane of the members: when gloo's communicators must be rebuilt, and the rebuild.

gloo caches its communicators per device list, not per incarnation, and keeps a dead life's
rendezvous keys, so on CPU a member set that gains a life (or whose communicators a failed
step left suspect) syncs before its step runs: clear stale keys, barrier, a fresh backend where
a member needs one, barrier, gloo's rendezvous. A member needs one when its backend holds a
communicator for the step's list built with other lives, or one a failure left suspect
(:mod:`jaxft.core.plane`); every member says so before the first barrier and all decide alike.
Otherwise (a spare swapped in for a dead member: a list nobody stepped on) the backend is kept
and the rendezvous opens a fresh communicator: no backend, no state moved, no program loaded
again. On GPU (NCCL) nothing here runs.

A step failed after its body began leaves the communicators built so far suspect: an
aborted all-reduce can leave a partial message on a pair, which the next collective would
read as its own ("Received data size doesn't match expected size", SIGABRT), and a member
whose collective failed broke its connections (:mod:`jaxft.worker.breaker`), which every
pair with it shares. A step over a suspect list rebuilds first; a step over a list not used
since the last rebuild gets a fresh communicator from gloo, so survivors of a failure go on
at their narrower width without a rebuild (and keep their compiled executables). Every
member of a failed step sees the same failure and the same history of lists since the last
rebuild, so all of them decide alike.

A replaced backend is freed only by a full garbage collection: its client and its devices
refer to each other. Until then its gloo communicators live on, and one whose peer died or
whose connections the breaker shut can spin its event loop (a busy ``epoll_wait``): in
schedule runs one member after most deaths burned a whole core until Python's own full
collection came, tens of seconds later. So the first commit on a rebuilt backend collects
(:meth:`DataPlane.after_commit`). To keep that cheap, :func:`jaxft.initialize` freezes
what exists before any backend does (the imports) out of every later collection
(``gc.freeze``): a full collection then examines ~22,000 objects instead of ~120,000 (6-22 ms
instead of 55-120 ms in a worker here). A backend something holds from C++ outlives this
(seen in schedule runs, docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
from jax.extend import backend as jax_backend
from jax.sharding import Mesh

from jaxft import _compat
from jaxft.core import plane
from jaxft.core.rejoin import is_new
from jaxft.timeouts import Timeouts
from jaxft.worker import breaker, kv, rendezvous
from jaxft.worker import deaths as deaths_lib
from jaxft.worker.deadpairs import DeadPairs
from jaxft.worker.hang import HangMonitor

logger = logging.getLogger(__name__)


def map_digest(member_map: Mapping[int, int]) -> str:
    """A short name of a member map (process -> incarnation), the same in every process."""
    text = ",".join(f"{p}:{i}" for p, i in sorted(member_map.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class DataPlane:
    """One process's view of its members' data plane: meshes, which device lists were used or
    are suspect, and the rebuild (see the module docstring)."""

    def __init__(self, process_id: int, axis_name: str, timeouts: Timeouts, hang: HangMonitor):
        self.process_id, self.axis_name, self.timeouts, self.hang = process_id, axis_name, timeouts, hang
        self.platform = jax.devices()[0].platform
        self._synced: dict[int, int] | None = None  # member map the data plane was built for
        # process-id lists stepped on since the last rebuild (each with the lives it was first used
        # with: this backend caches a communicator for it), alike on every member (a joiner that
        # kept the backend took the members' history: _sync)
        self._used: dict[tuple[int, ...], dict[int, int]] = {}
        self._suspect: set[tuple[int, ...]] = set()
        self._meshes: dict[tuple[int, ...], Mesh] = {}
        self._attempts: dict[str, int] = {}
        self._last_namespace: str | None = None
        self._pre: list[Callable[[], None]] = []
        self._post: list[Callable[[], None]] = []
        self._during: list[Callable[[], None]] = []
        self._canceller: deaths_lib.Canceller | None = None  # cancels the rebuild's barriers on a death
        self._tripwire: deaths_lib.Tripwire | None = None
        self._old_backends: list[tuple[weakref.ref, float]] = []  # (a client a rebuild replaced, when)
        self.last_reset: dict[str, float | bool] = {}  # seconds spent in the last sync, by part
        self.leaked_backends = 0  # rebuilds after which arrays of the old backend stayed alive
        self.replaced_alive = 0  # backends the rebuilds replaced still alive as the run finished
        self._collect = False  # a rebuild replaced a backend that no full collection freed yet
        self.dead_pairs = DeadPairs(process_id)  # (CPU only: armed by a failure)

    @property
    def needs_reset(self) -> bool:
        """CPU (gloo) caches communicators per device list without incarnations."""
        return self.platform == "cpu"

    def on_reset(self, before: Callable[[], None] | None = None, after: Callable[[], None] | None = None,
                 during: Callable[[], None] | None = None) -> None:
        """Register callbacks around a rebuild (arrays die with the backend: move them to host
        in ``before``, rebuild them in ``after``), and ``during`` any sync, between its barriers
        (a fault point), whether it rebuilds or keeps the backend."""
        if before is not None:
            self._pre.append(before)
        if after is not None:
            self._post.append(after)
        if during is not None:
            self._during.append(during)

    def mesh(self, devices: Sequence[jax.Device]) -> Mesh:
        """A cached 1-D mesh over ``devices``."""
        key = tuple(d.id for d in devices)
        mesh = self._meshes.get(key)
        if mesh is None:
            mesh = self._meshes[key] = Mesh(list(devices), (self.axis_name,))
        return mesh

    def taint(self) -> None:
        """A step failed after its body began: rebuild before the next one; and look for the dead
        connections gloo's loop keeps reporting after the next commits (:mod:`jaxft.worker.deadpairs`)."""
        if self.needs_reset:
            self._suspect |= set(self._used)
            self.dead_pairs.step_failed()

    def break_if_collective_failed(self, error: BaseException) -> None:
        """This process's collective failed: fail the others' now too (see :mod:`jaxft.worker.breaker`)."""
        if self.needs_reset and jax.process_count() > 1 and breaker.is_collective_failure(error):
            breaker.break_data_plane()
            self._suspect |= set(self._used)
            self.dead_pairs.step_failed()

    def tripwire(self, entry: Mapping[int, int], deaths: deaths_lib.DeathWatch) -> deaths_lib.Tripwire | None:
        """The step body's tripwire: a member recorded dead breaks this process's CPU data
        plane at once (the body's collective then fails here, whichever pair it waits on)."""
        if not self.needs_reset or len(entry) < 2 or not deaths.state_dir:
            return None
        if self._tripwire is None:
            def trip(dead: set[int]) -> None:
                n = breaker.break_data_plane()
                logger.info("process %d: members %s recorded dead during the step; broke %d connections",
                            self.process_id, sorted(dead), n)
                self.hang.doomed(f"member(s) {sorted(dead)} died")  # bounds a send gloo leaves pending

            self._tripwire = deaths_lib.Tripwire(deaths, trip)
        return self._tripwire

    def enter(self, devices: Sequence[jax.Device], current: Mapping[int, int],
              deaths: deaths_lib.DeathWatch | None) -> tuple[tuple[jax.Device, ...], bool, bool]:
        """Make the data plane ready for a step of ``current`` (process -> incarnation) on
        ``devices``: ``(devices sorted by id, whether it was synced (rebuilt, or connected afresh
        on the backend it has), whether the mesh is new)``."""
        key = tuple(sorted(current))
        sync = self.needs_reset and (is_new(self._synced, current) or plane.own_need(
            self._used, self._suspect, current, self._synced) == plane.NEEDS)
        if sync:
            if self._sync(current, deaths):
                devices = [d for d in jax.devices() if d.process_index in current]
        else:
            if self._synced is None:
                self._synced = dict(current)
            if self.needs_reset and key not in self._used:
                self._used[key] = dict(current)  # (first: a failed rendezvous leaves it suspect)
                self.hang.long_step()  # (compiles the rendezvous program)
                rendezvous.compile_for(devices)()
        ordered = tuple(sorted(devices, key=lambda d: d.id))
        return ordered, sync, tuple(d.id for d in ordered) not in self._meshes

    def _sync(self, current: Mapping[int, int], deaths: deaths_lib.DeathWatch | None) -> bool:
        """Agree whether to rebuild, clear stale rendezvous keys, barrier, rebuild the CPU backend
        where a member needs it (:mod:`jaxft.core.plane`), barrier, rendezvous: whether it rebuilt.

        A member set that gains a life whose members' communicators for its list are all unused
        (a spare swapped in for a dead member: a list nobody stepped on) keeps the backend: the
        rendezvous opens a fresh communicator, and the state, the compiled programs and the
        other lists' communicators stay (no backend, no state moved, no programs loaded again)."""
        self.hang.long_step()  # waits for every member, then recompiles: Timeouts.setup bounds it
        digest = map_digest(current)
        attempt = self._attempts.get(digest, 0)
        self._attempts[digest] = attempt + 1
        members = sorted(current)
        key = tuple(members)
        namespace = f"jaxft/reset/{digest}-{attempt}"
        if self.process_id == members[0]:
            _compat.delete_stale_cpu_keys(kv.client(), topology=False)
            if self._last_namespace is not None:  # every member passed it before this reset began
                kv.delete_dir(self._last_namespace)
        self._last_namespace = namespace
        # Two barriers that give up on a member whose life in ``current`` is over (the launcher
        # recorded its exit, it restarted, or its heartbeat stopped: jaxft.worker.lives; also
        # when it died before reaching them): before the rebuild, and after it, right before
        # the new backend's gloo rendezvous (jaxft.worker.rendezvous: compiled before the
        # barrier, run right after it). A member that dies between the second barrier and
        # publishing its rendezvous key is waited for by gloo's own bound (docs/design.md).
        cancel = threading.Event()
        barrier = kv.KVBarrier(namespace, members, self.process_id, cancel, timeouts=self.timeouts,
                               options=kv.BarrierOptions(what="reset", dead_after="save_dead_after",
                                                         unknown_after="reset", timeout_name="reset"),
                               lives=current)
        timeout_ms = int(self.timeouts.reset * 1000)
        mine = plane.answer(self._used, self._suspect, current, self._synced)
        c = kv.client()
        t0 = time.monotonic()
        with self._cancel_on_death(cancel, members, deaths):
            # (written before this member arrives: every answer is there once the barrier passes)
            c.key_value_set(f"{namespace}/need/{self.process_id}", json.dumps(mine), allow_overwrite=True)
            barrier(key="rebuild", timeout_ms=timeout_ms)
            t1 = time.monotonic()
            answers = [json.loads(v) for _, v in c.key_value_dir_get(f"{namespace}/need/")]
            rebuild = plane.rebuild_agreed([a["need"] for a in answers])
            if rebuild:
                self._rebuild_backend()
            elif mine["need"] == plane.FRESH:  # take the members' history: they decide alike with it
                self._used, self._suspect = plane.history(answers)
            for hook in self._during:
                hook()
            t2 = time.monotonic()
            if rebuild:
                for hook in self._post:
                    hook()
            self._synced = dict(current)
            self._used[key] = dict(current)
            connect_gloo = rendezvous.compile_for([d for d in jax.devices() if d.process_index in current])
            barrier(key="rebuilt", timeout_ms=timeout_ms)
            connect_gloo()
        self.last_reset = {"barrier_s": round(t1 - t0, 4), "backend_s": round(t2 - t1, 4),
                           "state_s": round(time.monotonic() - t2, 4), "rebuilt": rebuild}
        logger.info("process %d %s the CPU data plane for %s: %s", self.process_id,
                    "rebuilt" if rebuild else "kept", members, self.last_reset)
        return rebuild

    def _rebuild_backend(self) -> None:
        """Replace the CPU backend (its arrays and programs go with it: the hooks move them)."""
        for hook in self._pre:
            hook()
        self._meshes.clear()
        self._used.clear()
        self._suspect.clear()
        self._old_backends.append((weakref.ref(jax.devices()[0].client), time.monotonic()))
        self._collect = True
        self.dead_pairs.backend_replaced()
        if self.process_id == 0:
            # Process 0's new backend writes the global topology again (the old copy would
            # fail it with ALREADY_EXISTS): delete that copy only now, past the barrier. A
            # process starting its backend meanwhile waits for the key; deleted before the
            # barrier, while a rebuild that failed on a death left it unwritten, a restarted
            # process waited in its start-up for it, and the members waited for it at their
            # next step (until the topology timeout).
            _compat.delete_global_topology_key(kv.client())
        rendezvous.forget_programs()
        jax_backend.clear_backends()
        jax.devices()  # rebuild now, inside the step

    def after_commit(self) -> None:
        """After each commit: the first one since a rebuild (whose own step may have failed),
        when nothing of a step refers to the replaced backend any more, frees it (and its gloo
        communicators) with a full collection (see the module docstring); after a failure,
        quiet the dead connections gloo's loop keeps reporting (:mod:`jaxft.worker.deadpairs`)."""
        if self.needs_reset:
            self.dead_pairs.after_commit()
        if not self._collect:
            return
        self._collect = False
        t0 = time.monotonic()
        gc.collect()
        logger.debug("process %d: full collection after a rebuild in %.3f s", self.process_id, time.monotonic() - t0)

    @contextlib.contextmanager
    def _cancel_on_death(self, cancel: threading.Event, members: Sequence[int],
                         deaths: deaths_lib.DeathWatch | None) -> Iterator[None]:
        """While inside, ``cancel`` is set the moment the launcher records one of ``members`` dead
        (:class:`jaxft.worker.deaths.Canceller`; nothing without records or a DeathWatch)."""
        others = [p for p in members if p != self.process_id]
        if deaths is None or not deaths.state_dir or not others:
            yield
            return
        if self._canceller is None:
            self._canceller = deaths_lib.Canceller(deaths)
        with self._canceller.during(cancel, others):
            yield

    def report_old_backends(self) -> None:
        """Warn, once at the run's end, for each rebuild whose replaced CPU backend still has arrays.

        A jax array of it that is still referenced (the initial params the program created, a
        numpy view made by ``np.asarray`` of one) keeps the old backend's buffers alive for
        nothing, once per rebuild. Arrays that are garbage in reference cycles are listed too
        until a full ``gc.collect`` (after each rebuild's commit, :meth:`after_commit`, and
        here when some are listed). Also notes how many replaced backends are still alive
        (:attr:`replaced_alive`, before any collection here)."""
        olds, self._old_backends = self._old_backends, []
        self.replaced_alive = sum(ref() is not None for ref, _ in olds)  # (before any collection here)
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


def _held_arrays(client) -> list[str]:
    """``dtype[shape]`` of each array of ``client`` that is still alive (none if ``client`` is gone)."""
    if client is None:
        return []
    try:
        return sorted({f"{a.dtype}{list(a.shape)}" for a in client.live_arrays()})
    except Exception:  # noqa: BLE001 - a client that cannot list them holds none we can name
        return []

"""A step's program per mesh: built from the user's step, the votes summed in it, compiled once.

The loop runs one program per step over the members' mesh (1-D, the group's axis): the user's
step (a function jitted here with replicated outputs, or a :class:`~jaxft.MeshStep` built per
mesh) and, with ready admission, the members' votes (:mod:`jaxft.core.votes`) summed in the
same program. :class:`Programs` keeps one per device set, loads what another process compiled
(:mod:`jaxft.worker.executables`), compiles ahead for the warm-up, and checks each step
function's contract once (it leaves its input alone and returns a replicated state).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxft.core import votes as votes_lib
from jaxft.errors import ConfigError
from jaxft.types import PyTree
from jaxft.worker import executables as executables_lib
from jaxft.worker.arrays import host_copies, shapes
from jaxft.worker.data import batch_specs
from jaxft.worker.options import Batching, MeshStep

StepFn = Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, dict]]  # (state, batch, mask) -> (state, metrics)


def with_votes(fn: Callable, mesh: Mesh) -> Callable:
    """``fn`` plus the votes: ``(state, batch, mask, votes[D, W]) -> (..., agreed[W])``, one jitted
    program, so agreeing costs no extra round trip.

    The votes are summed in float32, so that XLA merges their all-reduce with the step's own
    (one all-reduce op per step, checked in the compiled program by ``tests/test_admission.py``).
    XLA's CPU backend still runs a tuple all-reduce as one gloo all-reduce per element, on one
    slot: a survivor a collective ahead of its peer could abort on chunks of the wrong size when
    a member dies between two of them. ``ElasticTrainer``'s step therefore sums its gradients,
    loss and votes in one buffer itself (``MeshStep(takes_votes=True)``); this wrapper is for
    steps brought along."""
    def step(state, batch, mask, votes):
        new_state, metrics = fn(state, batch, mask)
        return new_state, metrics, agree(votes)

    return jax.jit(step, out_shardings=NamedSharding(mesh, P()))


def agree(votes: jax.Array) -> jax.Array:
    """``agreed [W]`` from the members' votes ``[D, W]``: summed over the devices in float32, then
    :func:`agreed_votes`."""
    return agreed_votes(jnp.sum(votes.astype(jnp.float32), axis=0))


def agreed_votes(total: jax.Array) -> jax.Array:
    """``agreed [W] int32`` from the votes summed over the devices (``total [W]``, float32; see
    :mod:`jaxft.core.votes`): the admission columns as ``HOLD`` / ``READY`` / 0 (ready votes
    add up to at most the devices, a hold outweighs them all), the others as counts. A step
    that sums the votes itself returns this."""
    p = total.shape[-1] - votes_lib.EXTRA
    adm = total[..., :p]
    agreed = jnp.where(adm >= votes_lib.HOLD, votes_lib.HOLD, (adm > 0) * votes_lib.READY)
    return jnp.concatenate([agreed, total[..., p:]], axis=-1).astype(jnp.int32)


def votes_spec(mesh: Mesh, axis_name: str) -> jax.ShapeDtypeStruct:
    """The shape of :func:`votes_array`'s result, for compiling ahead of time."""
    return jax.ShapeDtypeStruct((mesh.devices.size, votes_lib.width(jax.process_count())), np.dtype(np.int32),
                                sharding=NamedSharding(mesh, P(axis_name)))


def votes_array(votes: np.ndarray, mesh: Mesh, axis_name: str) -> jax.Array:
    """This process's vote row (:func:`jaxft.core.votes.row`) on each of its devices, as a global
    ``[D, W]`` array."""
    n = mesh.devices.size
    rows = np.broadcast_to(votes, (n, votes.size))
    return jax.make_array_from_callback((n, votes.size), NamedSharding(mesh, P(axis_name)), lambda i: rows[i])


def shared_dir() -> str | None:
    """Where a run's processes share step programs (:mod:`jaxft.worker.executables`): beside jax's
    persistent compilation cache (``jaxft.initialize`` puts that under the run directory), or
    None without one."""
    cache = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # (jax's flags: no stubs)
    return os.path.join(cache, "jaxft-steps") if cache else None


def mesh_of(pids: tuple[int, ...], axis_name: str) -> Mesh:
    """The 1-D mesh a step over processes ``pids`` runs on (devices sorted by id, as in
    :class:`~jaxft.Members`)."""
    devices = sorted((d for d in jax.devices() if d.process_index in pids), key=lambda d: d.id)
    return Mesh(devices, (axis_name,))


class Programs:
    """The step's program per device set of one loop (see the module docstring).

    ``state`` and ``template`` give the loop's current state and a host batch's shapes (for
    the reference program that names what the processes share); ``voting``: the program sums
    the votes (ready admission)."""

    def __init__(self, step: StepFn | MeshStep, *, process_id: int, axis_name: str, batching: Batching,
                 voting: Callable[[], bool], precompile: bool, state: Callable[[], PyTree],
                 template: Callable[[], PyTree | None]):
        self.step, self.process_id, self.axis_name, self.batching = step, process_id, axis_name, batching
        self._voting, self._precompile, self._state, self._template = voting, precompile, state, template
        self._compiled: dict[tuple, Callable] = {}  # by mesh ids (("votes", *ids): the votes alone)
        self._checked: set[int] = set()  # ids of the step functions whose contract was checked
        self.executables = executables_lib.Executables(shared_dir(), reference=self.reference)

    @property
    def takes_votes(self) -> bool:
        return isinstance(self.step, MeshStep) and self.step.takes_votes

    def reset(self) -> None:
        """After a backend rebuild: every program is built again (the old ones hold its devices)."""
        self._compiled.clear()
        self.executables.reset()

    def for_mesh(self, mesh: Mesh) -> Callable:
        """The jitted step for ``mesh`` (one per device set; the background warm-up uses it too)."""
        key = executables_lib.mesh_ids(mesh)
        fn = self._compiled.get(key)
        if fn is None:
            if isinstance(self.step, MeshStep):
                fn = self.step.build(mesh)
            else:
                fn = jax.jit(self.step, out_shardings=NamedSharding(mesh, P()))
            if self._voting() and not self.takes_votes:
                fn = with_votes(fn, mesh)
            elif self._precompile and not hasattr(fn, "lower"):  # a plain function around jitted ones
                fn = jax.jit(fn, out_shardings=NamedSharding(mesh, P()))  # one program, to compile ahead
            fn = self._compiled.setdefault(key, fn)
        return fn

    def votes_only(self, mesh: Mesh) -> Callable:
        """A program that sums the votes alone (too few members to commit: see ``min_members``)."""
        key = ("votes",) + executables_lib.mesh_ids(mesh)
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled.setdefault(key, jax.jit(agree, out_shardings=NamedSharding(mesh, P())))
        return fn

    def call(self, mesh: Mesh, fn: Callable, args: tuple) -> Any:
        """``fn(*args)`` through :mod:`jaxft.worker.executables` (no tracing after a rebuild;
        programs the lowest member compiled are loaded by the others); a plain call for a step
        without ``lower``."""
        if not hasattr(fn, "lower"):
            return fn(*args)
        compiler = self.process_id == min(d.process_index for d in mesh.devices.flat)  # the others wait
        return self.executables.call(executables_lib.mesh_ids(mesh), fn, args, compiler)

    def job(self, mesh: Mesh, fn: Callable, args: tuple, before: Callable[[], bool] | None = None,
            on_cpu: bool = True) -> Callable:
        """What the step runner runs for one step: the program, then its outputs made ready.
        ``before()`` runs first (a fault point); a true answer skips the program (the caller
        left it)."""
        def program():
            if before is not None and before():
                return None
            outputs = self.call(mesh, fn, args)
            host = host_copies(outputs[1:], start=not on_cpu)  # metrics (and votes): to host memory
            return jax.block_until_ready(outputs[0]), jax.block_until_ready(host)

        return program

    def specs(self, mesh: Mesh, state_shapes: PyTree, template: PyTree) -> tuple[Callable, tuple]:
        """The step for ``mesh`` and the abstract arguments a step gives it."""
        fn = self.for_mesh(mesh)
        replicated = NamedSharding(mesh, P())
        state = jax.tree_util.tree_map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated, weak_type=s.weak_type), state_shapes)
        batch, mask = batch_specs(template, mesh, self.axis_name, self.batching.micro,
                                  flat=not self.batching.stacked, chunk=self.batching.chunk)
        args = (state, batch, mask) + ((votes_spec(mesh, self.axis_name),) if self._voting() else ())
        return fn, args

    def compile_for(self, mesh: Mesh, state_shapes: PyTree, template: PyTree) -> None:
        """Lower and compile the step for ``mesh`` with the arguments a step will give it."""
        fn, args = self.specs(mesh, state_shapes, template)
        if hasattr(fn, "lower"):
            self.executables.get(executables_lib.key(executables_lib.mesh_ids(mesh), args), fn, args)

    def preload_for(self, mesh: Mesh, state_shapes: PyTree, template: PyTree, stale: Callable[[], bool]) -> bool:
        """Load, without compiling, the step for ``mesh`` that another process compiles
        (:meth:`Executables.preload`); whether it is loaded."""
        fn, args = self.specs(mesh, state_shapes, template)
        return hasattr(fn, "lower") and self.executables.preload(
            executables_lib.key(executables_lib.mesh_ids(mesh), args), stale)

    def reference(self) -> str:
        """The step lowered for every process's devices: the same text in every process of a run
        with the same code and arguments, whatever mesh it first runs on (it names the programs
        the processes share, see :mod:`jaxft.worker.executables`)."""
        template = self._template()
        if template is None:
            raise RuntimeError("no batch yet")
        fn, args = self.specs(mesh_of(tuple(range(jax.process_count())), self.axis_name), shapes(self._state()),
                              template)
        lowered: Any = fn  # (a jitted step: the reference needs its ``lower``)
        return lowered.lower(*args).as_text()

    def check_contract(self, fn: Callable, state_in: PyTree, new_global: PyTree) -> None:
        """Once per step function: it must leave its input state alone (a donated input is gone,
        and a retry or a roll-back needs it) and return a replicated state (every member commits
        its own copy of it). Both are configuration errors, said in one line."""
        if id(fn) in self._checked:
            return
        self._checked.add(id(fn))
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree_util.tree_leaves(state_in)):
            raise ConfigError("the step function donated its input state (donate_argnums/donate_argnames): jaxft "
                              "keeps the state for a retry or a roll-back; jit the step without donating it")
        bad = [jax.tree_util.keystr(k) for k, x in jax.tree_util.tree_flatten_with_path(new_global)[0]
               if isinstance(x, jax.Array) and not x.sharding.is_fully_replicated]
        if bad:
            raise ConfigError(f"the step function returned a state that is not replicated over the members "
                              f"({', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}): return it with "
                              "out_shardings=NamedSharding(mesh, PartitionSpec())")

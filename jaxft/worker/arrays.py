"""Moving a state between host memory and the members' devices: the arrays of one step.

The loop keeps its state as this process's copy of a replicated tree; a step's program takes
the replicated global view of it (:func:`replicate`) and returns a new one, whose local copy
(:func:`local_copy`) is the next state. Host copies (:func:`to_host`) survive a backend rebuild.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxft.types import PyTree


def replicate(tree: PyTree, mesh: Mesh) -> PyTree:
    """A replicated global view of this process's copy (no data moves between processes)."""
    sharding = NamedSharding(mesh, P())
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]

    def one(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        return jax.make_array_from_single_device_arrays(np.shape(x), sharding,
                                                        [jax.device_put(x, d) for d in local])

    return jax.tree_util.tree_map(one, tree)


def local_copy(tree: PyTree) -> PyTree:
    """This process's copy of a replicated tree, as single-device arrays."""
    return jax.tree_util.tree_map(lambda x: x.addressable_data(0), tree)


def to_host(tree: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda x: np.array(x), tree)


def canonical(tree: PyTree) -> PyTree:
    """Host leaves (Python scalars, numpy arrays) as numpy arrays of the dtype JAX would give
    them (``0`` -> int32 without x64): the state has the same bytes on a process that has not
    stepped yet as on one holding a step's output, as the rejoin's transfer requires."""
    def one(x):
        if isinstance(x, jax.Array):
            return x
        a = np.asarray(x)
        return a.astype(jax.dtypes.canonicalize_dtype(a.dtype), copy=False)

    return jax.tree_util.tree_map(one, tree)


def host_copies(tree: PyTree, start: bool = True) -> PyTree:
    """This process's copy of each array leaf of a replicated ``tree``, with ``start`` its
    copy to host memory started (``copy_to_host_async``), so that reading it once the
    program is done waits for no transfer. Called right after the step's program is
    dispatched: on a GPU each scalar read after the program waits for its own transfer;
    started early, the copies overlap the program. On CPU the arrays are in host memory
    already, so ``start`` is off there (the copies would cost time for nothing)
    (measured: docs/benchmarks.md, 'Figures behind the code')."""
    def one(x):
        if not isinstance(x, jax.Array):
            return x
        x = x.addressable_data(0) if not x.is_fully_addressable else x
        if start:
            x.copy_to_host_async()
        return x

    return jax.tree_util.tree_map(one, tree)


def scalars(metrics: Any) -> dict[str, float]:
    """``metrics`` (as :func:`host_copies` returns them: this process's arrays) as floats."""
    if not isinstance(metrics, dict):
        metrics = {"loss": metrics} if metrics is not None else {}
    return {str(k): float(np.asarray(v)) for k, v in metrics.items()}


def shapes(tree: PyTree) -> PyTree:
    """``tree``'s leaves (numpy or jax arrays, see :func:`canonical`) as ShapeDtypeStructs."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=bool(getattr(x, "weak_type", False))), tree)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # in a default repr: <function f at 0x7f...>, <C object at 0x...>


def structure_text(treedef: Any) -> str:
    """A treedef's text without object addresses, alike in every process: a node's static data
    (a flax ``TrainState``'s ``apply_fn`` and ``tx``) prints its functions as
    ``<function f at 0x...>``, an address that differs from process to process."""
    return _ADDRESS.sub("", str(treedef))

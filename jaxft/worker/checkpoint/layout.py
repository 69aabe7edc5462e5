"""What a jaxft checkpoint holds, and its checksum.

A checkpoint of step ``N`` is one Orbax item (``state``) holding ``{"step": N, "leaves":
{name: array}}``: every leaf of the saved pytree as a host numpy array under a stable name
(``<index>_<keypath>``). The step metadata (Orbax's ``custom_metadata``) records the
format (:data:`FORMAT`), the step, the members and primary of the save, the tree's
structure, each leaf's ``[name, keypath, dtype, shape]`` and a SHA-256 over all of it
(:func:`state_checksum`). Zero-size leaves live in that layout only (Orbax refuses them).
A restore checks what it read against the layout and checksum (:func:`check_metadata`,
:func:`verified_leaves`) and rebuilds the pytree against a template of the model
(:func:`_unflatten_like`), which must match leaf by leaf.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxft.errors import CheckpointMismatch, CheckpointRejected
from jaxft.types import PyTree

FORMAT = "jaxft-checkpoint/1"


def _leaf_name(index: int, path) -> str:
    text = re.sub(r"[^A-Za-z0-9]+", "_", jax.tree_util.keystr(path)).strip("_")
    return f"{index:05d}_{text[:60]}" if text else f"{index:05d}"


def _host_copy(x) -> np.ndarray:
    """A private host copy (the device-to-host snapshot of a single-device or numpy leaf)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)  # a replicated global array: this process's replica
    return np.array(x, copy=True)


def flatten_state(tree: PyTree) -> tuple[dict[str, np.ndarray], list[list], Any]:
    """``(named host copies, [[name, keypath, dtype, shape]...], treedef)`` of a pytree."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    named: dict[str, np.ndarray] = {}
    layout = []
    for i, (path, leaf) in enumerate(leaves):
        arr = _host_copy(leaf)
        name = _leaf_name(i, path)
        named[name] = arr
        layout.append([name, jax.tree_util.keystr(path), arr.dtype.name, list(arr.shape)])
    return named, layout, treedef


def state_checksum(step: int, named: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over the step and every leaf's name, dtype, shape and bytes (in name order)."""
    h = hashlib.sha256(f"{FORMAT}\nstep={int(step)}\n".encode())
    for name in sorted(named):
        a = np.ascontiguousarray(named[name])
        h.update(f"{name}|{a.dtype.name}|{tuple(a.shape)}\n".encode())
        if a.size:
            h.update(a.reshape(-1).view(np.uint8).data)  # (the bytes, as a memoryview: no copy)
    return "sha256:" + h.hexdigest()


def _empty(dtype: str, shape) -> np.ndarray:
    try:
        return np.empty(tuple(shape), np.dtype(dtype))
    except TypeError:  # ml_dtypes names (bfloat16, float8_*) are not numpy built-ins
        import ml_dtypes

        return np.empty(tuple(shape), getattr(ml_dtypes, dtype))


def check_metadata(path: str, step: int, meta: Mapping[str, Any]) -> tuple[list, list[str], dict[str, np.ndarray]]:
    """``(layout, names of the stored leaves, {name: empty array})`` of a checkpoint's metadata;
    :class:`CheckpointRejected` if it is not jaxft metadata of ``step``."""
    if meta.get("format") != FORMAT or not meta.get("checksum") or "leaves" not in meta:
        raise CheckpointRejected(path, "metadata lacks the jaxft format, leaves or checksum")
    if int(meta.get("step", -1)) != int(step):
        raise CheckpointRejected(path, f"metadata says step {meta.get('step')}, directory says {step}")
    layout = meta["leaves"]
    names = [row[0] for row in layout if int(np.prod(row[3])) > 0]
    empty = {row[0]: _empty(row[2], row[3]) for row in layout if int(np.prod(row[3])) == 0}
    return layout, names, empty


def verified_leaves(path: str, step: int, meta: Mapping[str, Any], item: Any, names: list[str],
                    empty: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every leaf of a read-back ``item`` by name, checked against the recorded layout
    (complete, dtypes, shapes, step) and checksum; :class:`CheckpointRejected` otherwise."""
    leaves = item.get("leaves", {}) if isinstance(item, Mapping) else {}
    named = {n: np.asarray(leaves[n]) for n in names if n in leaves}
    if len(named) != len(names) or set(leaves) != set(names):
        raise CheckpointRejected(path, f"leaves missing or unexpected: {len(leaves)} read, {len(names)} recorded")
    named.update(empty)
    for name, _, dtype, shape in meta["leaves"]:
        a = named[name]
        if a.dtype.name != dtype or list(a.shape) != list(shape):
            raise CheckpointRejected(path, f"leaf {name} read as {a.dtype.name}{list(a.shape)}, "
                                           f"recorded {dtype}{list(shape)}")
    if int(np.asarray(item.get("step", -1))) != int(step):
        raise CheckpointRejected(path, f"stored step {item.get('step')} != {step}")
    got = state_checksum(step, named)
    if got != meta["checksum"]:
        raise CheckpointRejected(path, f"checksum mismatch (stored {meta['checksum'][:23]}..., "
                                       f"read {got[:23]}...)")
    return named


def _unflatten_like(template: PyTree, layout: list, named: Mapping[str, np.ndarray], path: str) -> PyTree:
    t_leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    if len(t_leaves) != len(layout):
        raise CheckpointMismatch(f"checkpoint {path} has {len(layout)} leaves, the model has {len(t_leaves)}; "
                                 "use another checkpoint directory for a different model")
    out = []
    for (kp, leaf), (name, keystr, dtype, shape) in zip(t_leaves, layout):
        want_dtype = np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))
        want_shape = list(np.shape(leaf))
        if jax.tree_util.keystr(kp) != keystr or want_dtype.name != dtype or want_shape != list(shape):
            raise CheckpointMismatch(
                f"checkpoint {path}: leaf {keystr} {dtype}{list(shape)} does not match the model's "
                f"{jax.tree_util.keystr(kp)} {want_dtype.name}{want_shape}; use another checkpoint "
                "directory for a different model")
        out.append(named[name])
    return jax.tree_util.tree_unflatten(treedef, out)

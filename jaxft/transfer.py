"""Moving small vectors and whole pytrees between the live devices.

Everything goes through ordinary jitted collectives on the step's mesh, so it works on
gloo (CPU) and NCCL (GPU) alike and fails like any other collective when a peer dies.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxft.types import PyTree
DEFAULT_CHUNK_BYTES = 16 << 20  # bounds the extra memory of a transfer per process


def _local_devices(mesh: Mesh) -> list[jax.Device]:
    pid = jax.process_index()
    return [d for d in mesh.devices.flat if d.process_index == pid]


def _rows_array(row: np.ndarray, mesh: Mesh, axis_name: str) -> jax.Array:
    """A ``[D, k]`` array sharded over ``axis_name``; this process's devices hold ``row``."""
    num = mesh.devices.size
    sharding = NamedSharding(mesh, P(axis_name))
    shards = [jax.device_put(row[None], d) for d in _local_devices(mesh)]
    return jax.make_array_from_single_device_arrays((num,) + row.shape, sharding, shards)


def _identity(x):
    return x


def _sum0(x):
    return jnp.sum(x, axis=0)


def _replicating(fn, mesh: Mesh):
    """``fn`` jitted to return a replicated result (jax caches the executable)."""
    return jax.jit(fn, out_shardings=NamedSharding(mesh, P()))


def allgather_rows(row: np.ndarray, mesh: Mesh, axis_name: str = "data") -> np.ndarray:
    """Every device contributes ``row`` (``[k]``); returns ``[D, k]`` in mesh order."""
    x = _rows_array(np.asarray(row), mesh, axis_name)
    out = _replicating(_identity, mesh)(x)
    return np.asarray(jax.block_until_ready(out).addressable_data(0))


def tree_nbytes(tree: PyTree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree))


def tree_sha256(tree: PyTree) -> str:
    """sha256 over the leaves' bytes (with dtype and shape) in tree-flatten order."""
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def tree_norm(tree: PyTree) -> float:
    """float64 L2 norm over all leaves."""
    return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree_util.tree_leaves(tree))))


def _to_words(tree: PyTree) -> np.ndarray:
    parts = [np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8) for x in jax.tree_util.tree_leaves(tree)]
    raw = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    pad = (-raw.size) % 4
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, np.uint8)])
    return raw.view(np.uint32)


def _from_words(words: np.ndarray, template: PyTree) -> PyTree:
    raw = words.view(np.uint8)
    leaves, treedef = jax.tree_util.tree_flatten(template)
    out, offset = [], 0
    for leaf in leaves:
        a = np.asarray(leaf)
        n = a.nbytes
        out.append(raw[offset:offset + n].view(a.dtype).reshape(a.shape).copy())
        offset += n
    return jax.tree_util.tree_unflatten(treedef, out)


def broadcast_tree(tree: PyTree, donor: int, mesh: Mesh, axis_name: str = "data",
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> PyTree:
    """Every process gets process ``donor``'s ``tree`` (same structure, shapes, dtypes).

    The bytes travel as ``uint32`` words in chunks of at most ``chunk_bytes``: each
    chunk is a sum-all-reduce to which only the donor contributes non-zeros, so the
    result is bit-exact and the extra memory is a few chunks, whatever the tree's size.
    """
    is_donor = jax.process_index() == donor
    words = _to_words(tree)
    total = words.size
    chunk = max(1, chunk_bytes // 4)
    received = np.empty(total, np.uint32)
    zeros = np.zeros(min(chunk, max(total, 1)), np.uint32)
    summed = _replicating(_sum0, mesh)
    for start in range(0, total, chunk):
        stop = min(total, start + chunk)
        row = words[start:stop] if is_donor else zeros[: stop - start]
        out = summed(_rows_array(row, mesh, axis_name))
        received[start:stop] = np.asarray(jax.block_until_ready(out).addressable_data(0))
    return _from_words(received, tree)


def check_consistent(tree: PyTree, mesh: Mesh, axis_name: str = "data") -> list[int]:
    """All-gather a hash of ``tree``; returns the process ids that disagree with the
    majority (empty when every member holds bitwise-identical values)."""
    digest = np.frombuffer(bytes.fromhex(tree_sha256(tree))[:16], np.uint32).copy()
    rows = allgather_rows(digest, mesh, axis_name)
    procs = [d.process_index for d in mesh.devices.flat]
    keys = [r.tobytes() for r in rows]
    return disagreeing(procs, keys)


def disagreeing(processes: list[int], keys: list[bytes]) -> list[int]:
    """The processes whose key differs from the majority's. A tie goes to the key held by
    the lowest process id, so every member blames the same processes."""
    holders: dict[bytes, list[int]] = {}
    for p, k in zip(processes, keys):
        holders.setdefault(k, []).append(p)
    majority = min(holders, key=lambda k: (-len(holders[k]), min(holders[k])))
    return sorted({p for p, k in zip(processes, keys) if k != majority})

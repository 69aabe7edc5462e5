"""Moving small vectors and whole pytrees between the live devices.

Everything goes through ordinary jitted collectives on the step's mesh, so it works on
gloo (CPU) and NCCL (GPU) alike and fails like any other collective when a peer dies.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxft.types import PyTree

DEFAULT_CHUNK_BYTES = 8 << 20  # bounds the extra memory of a transfer per process


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


def _replicating(fn, mesh: Mesh):
    """``fn`` jitted to return a replicated result (jax caches the executable)."""
    return jax.jit(fn, out_shardings=NamedSharding(mesh, P()))


def _as_words(dtype: Any) -> tuple[np.dtype, int]:
    """What a row of ``dtype`` travels as, and how many of those per element: 64-bit values as
    pairs of int32 (jax without ``jax_enable_x64`` would cut them to 32 bits: an int64 step or
    hash all-gathered kept only its low half)."""
    dtype = np.dtype(dtype)
    return (np.dtype(np.int32), 2) if dtype.itemsize == 8 else (dtype, 1)


def allgather_rows(row: np.ndarray, mesh: Mesh, axis_name: str = "data") -> np.ndarray:
    """Every device contributes ``row`` (``[k]``); returns ``[D, k]`` in mesh order, bit for bit
    (64-bit dtypes included, whatever ``jax_enable_x64`` says)."""
    row = np.ascontiguousarray(row)
    word, _ = _as_words(row.dtype)
    x = _rows_array(row.view(word), mesh, axis_name)
    out = _replicating(_identity, mesh)(x)
    return np.asarray(jax.block_until_ready(out).addressable_data(0)).view(row.dtype)


def compile_allgather(row_len: int, dtype: Any, mesh: Mesh, axis_name: str = "data") -> None:
    """Compile, without running, what :func:`allgather_rows` of a ``[row_len]`` row of ``dtype``
    over ``mesh`` runs (e.g. ahead of a rejoin's agreement: into jax's persistent cache)."""
    word, per = _as_words(dtype)
    sharding = NamedSharding(mesh, P(axis_name))
    spec = jax.ShapeDtypeStruct((mesh.devices.size, row_len * per), word, sharding=sharding)
    _replicating(_identity, mesh).lower(spec).compile()


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


def save_tree(path: str, tree: PyTree) -> None:
    """Write ``tree``'s leaves to ``path`` (``.npz``), one array per leaf named by its key
    path (``jax.tree_util.keystr``), for leaf-by-leaf comparisons between runs."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    arrays: dict[str, Any] = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    np.savez(path, **arrays)


def tree_norm(tree: PyTree) -> float:
    """float64 L2 norm over all leaves."""
    return float(np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree_util.tree_leaves(tree))))


def _leaf_meta(leaf) -> tuple[tuple[int, ...], np.dtype]:
    """A leaf's shape and dtype without touching its data (as ``np.asarray`` would see them)."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return tuple(leaf.shape), np.dtype(leaf.dtype)
    a = np.asarray(leaf)
    return a.shape, a.dtype


def _flat_bytes(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes as a flat ``uint8`` view (a copy only when ``a`` is not C-contiguous)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


@functools.lru_cache(maxsize=32)
def _broadcaster(mesh: Mesh, axis_name: str, source: int):
    """A jitted ``[D, k] -> [D, k]`` (sharded over ``axis_name``) that copies row ``source`` to
    every row as a binomial tree of ``ppermute`` rounds: ceil(log2 D) rounds, each device
    receives the bytes exactly once, nothing is summed. The other rows must come in as zeros
    (the rounds OR what arrives into them, which is exact because each gets one non-zero input)."""
    num = mesh.devices.size
    rounds = []
    span = 1
    while span < num:
        rounds.append([((source + p) % num, (source + p + span) % num) for p in range(span) if p + span < num])
        span *= 2

    def body(x):
        if len(rounds) == 1:  # two devices: the receiver's row is what arrives (the donor's is unused)
            return jax.lax.ppermute(x, axis_name, rounds[0])
        for perm in rounds:
            x = x | jax.lax.ppermute(x, axis_name, perm)
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis_name), out_specs=P(axis_name)))


def forget_programs() -> None:
    """Before a backend rebuild: drop the broadcast programs kept per mesh (a mesh holds the
    old backend's devices, and with them the whole backend)."""
    _broadcaster.cache_clear()


def _chunk_len(nbytes: int, chunk: int) -> int:
    """The length a chunk of ``nbytes`` travels as: full chunks as they are, a short last one
    rounded up to a power of two (>= 4 KiB), so a transfer compiles at most a few shapes."""
    if nbytes >= chunk:
        return chunk
    return min(chunk, max(4096, 1 << (nbytes - 1).bit_length()))


def compile_broadcast(nbytes: int, donor: int, mesh: Mesh, axis_name: str = "data",
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Compile, without running, the programs :func:`broadcast_tree` of ``nbytes`` from
    ``donor`` over ``mesh`` will run (at most two chunk lengths), e.g. ahead of a rejoin, so
    that the transfer finds them in jax's caches (the persistent one included)."""
    devices = list(mesh.devices.flat)
    source = next(i for i, d in enumerate(devices) if d.process_index == donor)
    send = _broadcaster(mesh, axis_name, source)
    sharding = NamedSharding(mesh, P(axis_name))
    chunk = max(1, int(chunk_bytes))
    lengths = {_chunk_len(min(chunk, nbytes), chunk), _chunk_len(nbytes % chunk or chunk, chunk)}
    for length in sorted(lengths):
        send.lower(jax.ShapeDtypeStruct((len(devices), length), np.dtype(np.uint8), sharding=sharding)).compile()


def broadcast_tree(tree: PyTree, donor: int, mesh: Mesh, axis_name: str = "data",
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> PyTree:
    """Every process gets process ``donor``'s ``tree`` (same structure, shapes, dtypes).

    The leaves' bytes stream in tree-flatten order, in chunks of at most ``chunk_bytes``
    (leaves packed together, a large leaf cut up); each chunk is one jitted ``ppermute``
    broadcast from the donor's device (see :func:`_broadcaster`), and every receiver copies
    it straight into its output leaves. Bit-exact; the extra host memory on every process
    (donor, joiners, bystanders) is a few chunks whatever the tree's size. The donor returns
    its own leaves as numpy arrays (no copy; a view of a jax array's host buffer); the others
    return freshly allocated ones.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    pid = jax.process_index()
    is_donor = pid == donor
    if is_donor:
        out = [np.asarray(x) for x in leaves]
        srcs: list[np.ndarray] = out
    else:
        out = [np.empty(*_leaf_meta(x)) for x in leaves]
        srcs = []  # (only the donor reads its sources)
    views: list[Any] = [_flat_bytes(a) if not is_donor or a.flags.c_contiguous else None for a in out]
    sizes = [a.nbytes for a in out]
    total = sum(sizes)
    if total == 0:
        return jax.tree_util.tree_unflatten(treedef, out)

    devices = list(mesh.devices.flat)
    source = next((i for i, d in enumerate(devices) if d.process_index == donor), None)
    if source is None:
        raise ValueError(f"donor process {donor} has no device in the mesh")
    local = [d for d in devices if d.process_index == pid]
    num = len(devices)
    sharding = NamedSharding(mesh, P(axis_name))
    send = _broadcaster(mesh, axis_name, source)
    chunk = max(1, int(chunk_bytes))
    staging: np.ndarray | None = None  # the donor's buffer for chunks that straddle leaves (or are padded)
    zeros: dict[int, list[jax.Array]] = {}  # a receiver's all-zero input shards, by length

    leaf, offset = 0, 0  # the stream position: leaf index and byte offset in it
    for start in range(0, total, chunk):
        n = min(chunk, total - start)
        length = _chunk_len(n, chunk)
        if is_donor:
            while sizes[leaf] == offset:  # skip empty / finished leaves (and drop their views)
                views[leaf], leaf, offset = None, leaf + 1, 0
            if length == n and sizes[leaf] - offset >= n:
                if views[leaf] is None:
                    views[leaf] = _flat_bytes(srcs[leaf])
                row = views[leaf][offset:offset + n]
                offset += n
            else:
                if staging is None or staging.size < length:
                    staging = np.zeros(length, np.uint8)
                row, filled = staging[:length], 0
                while filled < n:
                    while sizes[leaf] == offset:
                        views[leaf], leaf, offset = None, leaf + 1, 0
                    if views[leaf] is None:
                        views[leaf] = _flat_bytes(srcs[leaf])
                    k = min(n - filled, sizes[leaf] - offset)
                    row[filled:filled + k] = views[leaf][offset:offset + k]
                    filled, offset = filled + k, offset + k
            shards = [jax.device_put(row[None], d) for d in local]
        else:
            if length not in zeros:
                z = np.zeros((1, length), np.uint8)
                zeros[length] = [jax.device_put(z, d) for d in local]
            shards = zeros[length]
        x = jax.make_array_from_single_device_arrays((num, length), sharding, shards)
        got = jax.block_until_ready(send(x))
        if is_donor:
            continue
        data = np.asarray(got.addressable_data(0)).reshape(-1)
        filled = 0
        while filled < n:
            while sizes[leaf] == offset:
                views[leaf], leaf, offset = None, leaf + 1, 0
            k = min(n - filled, sizes[leaf] - offset)
            views[leaf][offset:offset + k] = data[filled:filled + k]
            filled, offset = filled + k, offset + k
        del got, data
    return jax.tree_util.tree_unflatten(treedef, out)


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

"""``jaxft bench checkpoint``: the step loop's blocking time of an async save vs a synchronous
save of the same (~100 MB) state."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import jax
import numpy as np

from jaxft.events import EventLog
from jaxft.worker.checkpoint import managers
from jaxft.worker.checkpoint.layout import FORMAT, flatten_state, state_checksum
from jaxft.worker.checkpoint.store import CheckpointStore


def _bench_state(nbytes: float, seed: int = 0):
    import jax.numpy as jnp

    n_leaves = 8
    per = int(nbytes) // (4 * n_leaves)
    side = int(np.sqrt(per))
    rng = np.random.default_rng(seed)
    params = {f"w{i}": jnp.asarray(rng.standard_normal((side, per // side), dtype=np.float32))
              for i in range(n_leaves)}
    jax.block_until_ready(params)
    return params


def bench_async_vs_sync(nbytes: float = 100e6, repeats: int = 3, directory: str | None = None) -> dict:
    """Step-loop blocking time of an async save vs the time of a synchronous save.

    Single process, a ~``nbytes`` state of float32 jax arrays. Async: the time
    :meth:`CheckpointStore.save` keeps the caller (host snapshot + Orbax's blocking
    phase), and the time until the save is published. Sync: the same state saved by an
    Orbax ``CheckpointManager`` with async checkpointing off (same handler and format).
    """
    params = _bench_state(nbytes)
    size = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    root = directory or tempfile.mkdtemp(prefix="jaxft-ckpt-bench-")
    events = EventLog(None, jax.process_index())
    try:
        store = CheckpointStore(os.path.join(root, "async"), keep=2, events=events)
        blocking, total = [], []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            save = store.save(i + 1, params)
            t1 = time.perf_counter()
            if save is None:
                raise RuntimeError("async save failed in its blocking phase (see checkpoint_abandoned)")
            save.wait()
            t2 = time.perf_counter()
            if not save.ok:
                raise RuntimeError(f"async save failed: {save.reason}")
            if i:  # the first save pays one-time costs (imports, tensorstore contexts)
                blocking.append(t1 - t0)
                total.append(t2 - t0)
        store.close()

        sync_dir = os.path.join(root, "sync")
        os.makedirs(sync_dir, exist_ok=True)
        me = jax.process_index()
        sync_times = []
        for i in range(repeats + 1):
            mgr = managers.sync_manager(sync_dir, me, keep=2)
            t0 = time.perf_counter()
            named, layout, _ = flatten_state(params)
            meta = {"format": FORMAT, "step": i + 1, "leaves": layout,
                    "checksum": state_checksum(i + 1, named)}
            mgr.save(i + 1, args=managers.save_args({"step": np.asarray(i + 1, np.int64), "leaves": named}),
                     custom_metadata=meta, force=True)
            mgr.wait_until_finished()
            t1 = time.perf_counter()
            mgr.close()
            if i:
                sync_times.append(t1 - t0)
    finally:
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "bytes": size,
        "async_blocking_s": float(np.median(blocking)),
        "async_total_s": float(np.median(total)),
        "sync_s": float(np.median(sync_times)),
    }
    result["ratio_blocking_over_sync"] = result["async_blocking_s"] / result["sync_s"]
    return result


def format_figures(r: dict) -> str:
    """The result of :func:`bench_async_vs_sync` as the lines ``jaxft bench checkpoint`` prints."""
    return "\n".join([
        f"state: {r['bytes'] / 1e6:.1f} MB",
        f"async save, step-loop blocking time: {r['async_blocking_s'] * 1000:8.1f} ms "
        f"(published after {r['async_total_s'] * 1000:.1f} ms)",
        f"synchronous save:                    {r['sync_s'] * 1000:8.1f} ms",
        f"ratio blocking / sync:               {r['ratio_blocking_over_sync']:8.3f}",
    ])

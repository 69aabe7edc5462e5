"""The Orbax managers jaxft saves and reads with, built on Orbax's public API.

One place for how a save by the live set maps onto Orbax options, so that
:mod:`~jaxft.worker.checkpoint.store` only calls builders and plain ``CheckpointManager``
methods. The internals these managers need (the primary's numpy handler, the save's
barrier) come from :mod:`~jaxft.worker.checkpoint.orbax`, the shim.

Public Orbax API used for what jaxft needs
------------------------------------------
* ``MultiprocessingOptions(primary_host=min(live), active_processes=set(live),
  barrier_sync_key_prefix=...)``: every barrier of a save is scoped to its live members
  (none falls back to ``sync_global_devices``) and the primary is a live process.
* ``AsyncOptions(barrier_sync_fn=..., create_directories_asynchronously=False)``: the
  barriers of the background phase go through :class:`~jaxft.worker.checkpoint.orbax.SaveBarrier`
  (a :class:`jaxft.worker.kv.KVBarrier`), which gives up as soon as a missing member is dead;
  step directories are created synchronously, so no Orbax "signal" crosses processes.
* ``CheckpointManager.reached_preemption`` (a public method) is overridden to say no:
  Orbax asks JAX's preemption sync point at every save, and after a SIGTERM notice that
  agreement involves every process of the job, dead ones included.
* ``orbax.checkpoint.multihost.process_index`` and ``ocp.path.step.is_path_finalized``
  (public re-exports, formerly imported from ``orbax.checkpoint._src``), and
  ``ocp.path.step.TMP_DIR_SUFFIX`` (formerly a copied literal).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxft.worker.checkpoint import orbax_logs
from jaxft.worker.checkpoint.orbax import PrimaryNumpyHandler, SaveBarrier, ocp

orbax_logs.install()

STATE_ITEM = "state"  # the one item of a jaxft checkpoint (Composite args)
TMP_SUFFIX = ocp.path.step.TMP_DIR_SUFFIX  # ".orbax-checkpoint-tmp": a save not published yet


class LiveSetCheckpointManager(ocp.CheckpointManager):
    """A ``CheckpointManager`` without JAX's preemption sync point.

    Orbax asks ``multihost_utils.reached_preemption_sync_point`` at every save; after a
    SIGTERM notice that agreement involves every process of the job, dead ones included.
    jaxft saves on its own schedule, over the live set only. (Overrides a public method.)
    """

    def reached_preemption(self, step: int) -> bool:
        return False


def registry(mp: ocp.options.MultiprocessingOptions, numpy_handler: PrimaryNumpyHandler):
    """A handler registry for the ``state`` item whose numpy arrays go through ``numpy_handler``."""
    handler = ocp.PyTreeCheckpointHandler(
        multiprocessing_options=mp,
        type_handler_registry=ocp.type_handlers.create_type_handler_registry((np.ndarray, numpy_handler)))
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    reg.add(STATE_ITEM, ocp.args.PyTreeSave, handler)
    reg.add(STATE_ITEM, ocp.args.PyTreeRestore, handler)
    return reg


def save_manager(directory: str, members: Sequence[int], prefix: str, *, keep: int | None, barrier: SaveBarrier,
                 async_timeout_s: float, before_commit: Callable[[], None] | None) -> LiveSetCheckpointManager:
    """The async manager of one save by ``members`` (primary ``members[0]``)."""
    members = tuple(members)
    mp = ocp.options.MultiprocessingOptions(primary_host=members[0], active_processes=set(members),
                                            barrier_sync_key_prefix=prefix)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=False, enable_async_checkpointing=True,
        async_options=ocp.AsyncOptions(timeout_secs=max(1, int(async_timeout_s)), barrier_sync_fn=barrier,
                                       create_directories_asynchronously=False),
        multiprocessing_options=mp, save_root_metadata=False, cleanup_tmp_directories=False,
        lightweight_initialize=True)
    handler = PrimaryNumpyHandler(members[0], before_commit)
    return LiveSetCheckpointManager(directory, options=options, handler_registry=registry(mp, handler))


def read_manager(directory: str, me: int) -> LiveSetCheckpointManager:
    """A read-only manager of this process alone (no barrier with anyone)."""
    mp = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                            barrier_sync_key_prefix=f"jaxft_ckpt_read_{me}")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, enable_async_checkpointing=False,
                                           save_interval_steps=0,
                                           multiprocessing_options=mp, save_root_metadata=False,
                                           lightweight_initialize=True)
    return LiveSetCheckpointManager(directory, options=options,
                                    handler_registry=registry(mp, PrimaryNumpyHandler(me)))


def sync_manager(directory: str, me: int, keep: int | None) -> LiveSetCheckpointManager:
    """A synchronous manager of this process alone, same handler and format (benchmarks)."""
    mp = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=False, enable_async_checkpointing=False,
                                           multiprocessing_options=mp, save_root_metadata=False)
    return LiveSetCheckpointManager(directory, options=options,
                                    handler_registry=registry(mp, PrimaryNumpyHandler(me)))


def save_args(item: Mapping[str, Any]):
    """``CheckpointManager.save`` args for the ``state`` item ``item``."""
    return ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeSave(item)})


def restore_args(names: Sequence[str]):
    """``CheckpointManager.restore`` args reading ``step`` and ``leaves/<name>`` as numpy arrays."""
    np_args = ocp.RestoreArgs(restore_type=np.ndarray)
    return ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeRestore(
        restore_args={"step": np_args, "leaves": {n: np_args for n in names}})})


# -- step directories: published, or abandoned before publication -------------------------------

def remove_stale_tmp(directory: str, published_step: int) -> None:
    """Delete abandoned ``<n>.orbax-checkpoint-tmp`` dirs older than a published step.

    (A save of an older step still running elsewhere could only publish a checkpoint
    that is already superseded; losing it costs nothing.)
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(r"(\d+)" + re.escape(TMP_SUFFIX) + r".*", name)
        if m and int(m.group(1)) < published_step:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def newest_published_after(directory: str, step: int) -> int | None:
    """The newest published step of ``directory`` after ``step``, if any (one listing)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    newer = sorted((int(n) for n in names if n.isdigit() and int(n) > step), reverse=True)
    return next((n for n in newer if is_finalized(os.path.join(directory, str(n)))), None)


def is_finalized(path: str) -> bool:
    """Whether ``path`` is a published (finalized) Orbax step directory."""
    try:
        return os.path.isdir(path) and bool(ocp.path.step.is_path_finalized(path))
    except Exception:  # noqa: BLE001
        return False

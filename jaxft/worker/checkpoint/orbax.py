"""The Orbax adapter: the only module of jaxft that touches Orbax internals.

Everything else in :mod:`jaxft.worker.checkpoint` talks to Orbax through the builders here
(:func:`save_manager`, :func:`read_manager`, :func:`sync_manager`, :func:`save_args`,
:func:`restore_args`) and plain ``CheckpointManager`` methods. Written against
``orbax-checkpoint`` 0.12.x; ``tests/test_checkpoint.py`` checks the behaviour behind each
internal used here and fails loudly when one moves.

Public Orbax API used for what jaxft needs
------------------------------------------
* ``MultiprocessingOptions(primary_host=min(live), active_processes=set(live),
  barrier_sync_key_prefix=...)``: every barrier of a save is scoped to its live members
  (none falls back to ``sync_global_devices``) and the primary is a live process.
* ``AsyncOptions(barrier_sync_fn=..., create_directories_asynchronously=False)``: the
  barriers of the background phase go through :class:`SaveBarrier` (a
  :class:`jaxft.worker.kv.KVBarrier`), which gives up as soon as a missing member is dead;
  step directories are created synchronously, so no Orbax "signal" crosses processes.
* ``CheckpointManager.reached_preemption`` (a public method) is overridden to say no:
  Orbax asks JAX's preemption sync point at every save, and after a SIGTERM notice that
  agreement involves every process of the job, dead ones included.
* ``orbax.checkpoint.multihost.process_index`` and ``ocp.path.step.is_path_finalized``
  (public re-exports, formerly imported from ``orbax.checkpoint._src``), and
  ``ocp.path.step.TMP_DIR_SUFFIX`` (formerly a copied literal).

Internals that remain, and why (no public equivalent in 0.12.8)
---------------------------------------------------------------
1. **The numpy handler writes from the save's primary.** Orbax's ``NumpyHandler``
   writes replicated numpy arrays only where ``process_index() == 0`` and has no
   ``primary_host`` option; with process 0 dead it would publish a checkpoint without
   data. :class:`PrimaryNumpyHandler` overrides its private ``_background_serialize``
   (using ``_open_and_write``, ``_metadata_key``, ``_override_ocdbt_process_id`` and
   ``_src.serialization`` ``tensorstore_utils.build_array_write_spec`` /
   ``ocdbt_utils.get_process_index_for_subdir``), so the on-disk format is Orbax's own.
   ``ArrayHandler(primary_host=...)`` is no substitute: it saves ``jax.Array`` s (with
   sharding metadata, i.e. another format) and the state here is a host snapshot.
   Replace with a ``NumpyHandler(primary_host=...)`` option.
2. **The bound of Orbax's blocking barriers.** Inside ``CheckpointManager.save`` and the
   directory creation, Orbax calls ``sync_global_processes`` with no timeout or with
   ``multihost.coordination_timeout()``; both read the private module constant
   ``_src.multihost.multihost._DEFAULT_BARRIER_TIMEOUT`` (300 s), which no option sets
   (the public ``ocp.multihost.sync_global_processes(timeout=...)`` only helps callers of
   it). :func:`set_barrier_timeout` overrides it (``Timeouts.save_barrier``). Replace
   with a barrier-timeout field of ``MultiprocessingOptions``/``CheckpointManagerOptions``.
3. **The awaitable-signal key prefix.** Orbax keys its "awaitable signals" in the
   coordination service by a per-process operation counter. The service outlives the
   workers here, so a restarted process would count from 1 again and meet the keys an
   abandoned save of a dead life left behind. :func:`private_signal_keys` sets the
   private class attribute
   ``_src.futures.future.AwaitableSignalsContract.awaitable_signals_contract_prefix``
   to a per-life value. (``enable_per_process_directory_creation`` only appends the
   process index, which a restarted process shares.) Replace with a per-manager
   operation-id namespace option.
4. **Orbax's barrier names** ``async_commit_complete`` (the async checkpointer, after
   the primary published) and ``ThreadSaveMultiHostValueHolder:set_value_start`` (the
   manager's save-in-progress flag, reset in a ``finally`` of ``_finalize``):
   :class:`SaveBarrier` recognises them so that a process whose background phase failed
   says so at once instead of letting its peers wait until their timeout. Replace with
   an error callback of the async checkpointer (or a barrier fn that is told failures).
5. **``CheckpointManager._checkpointer.close()``** in :func:`close_quietly`, only when
   ``close()`` itself raised (a failed save re-raises there): the checkpointer's threads
   must still be released. Replace with a ``close()`` that does not re-raise.
6. **The blocking phase's barrier function.** ``CheckpointManager.save`` syncs its blocking
   phase (``save_start``, ``old_steps_to_remove``, ...) with ``sync_global_processes``,
   which takes its barrier from the private module function
   ``_src.multihost.multihost.get_barrier_sync_fn`` (``wait_at_barrier``: a member that
   died there held the others for the whole bound, 60 s in a chaos run).
   :func:`blocking_barriers` makes it return the save's :class:`SaveBarrier` (in any
   thread: Orbax awaits some of them in a helper thread), so that a death there abandons
   the save at once. Replace with a
   ``barrier_sync_fn`` field of ``MultiprocessingOptions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from jaxft.errors import UnsupportedOrbax

# The orbax-checkpoint releases this adapter is written and tested against (pyproject.toml's
# bound). Checked here, before any save: a checkout run without installing (PYTHONPATH) gets
# no resolver's check, and orbax-checkpoint 0.12.4 (seen on a GPU machine's image) saved
# fine but failed every restore (NumpyHandler has no ``deepcopy_host_arrays`` there).
SUPPORTED_ORBAX = ((0, 12, 8), (0, 13))  # >= first, < second


def check_orbax_version(found: str) -> None:
    """Raise :class:`~jaxft.errors.UnsupportedOrbax` unless ``found`` is in :data:`SUPPORTED_ORBAX`."""
    low, high = SUPPORTED_ORBAX
    parts = tuple(int(x) for x in re.findall(r"\d+", found)[:3])
    if not low <= parts < high:
        need = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
        raise UnsupportedOrbax(f"jaxft's checkpoints need orbax-checkpoint{need}, found {found}: "
                              f"pip install 'orbax-checkpoint{need}'")


def _installed_orbax() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("orbax-checkpoint")
    except PackageNotFoundError:  # imported from a source tree: ask the module
        import orbax.checkpoint

        return getattr(orbax.checkpoint, "__version__", "0")


check_orbax_version(_installed_orbax())

import orbax.checkpoint as ocp

# Private (see the module docstring, items 1-3).
from orbax.checkpoint._src.futures import future as _ocp_future
from orbax.checkpoint._src.multihost import multihost as _ocp_multihost
from orbax.checkpoint._src.serialization import ocdbt_utils as _ocp_ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as _ocp_ts_utils
from orbax.checkpoint.multihost import process_index

from jaxft.errors import SaveAbandoned
from jaxft.timeouts import Timeouts
from jaxft.worker import kv

# -- 0. Orbax's log lines that report what jaxft does on purpose ----------------------------------

# Messages Orbax logs (through absl, i.e. the "absl" Python logger) on every save or rebuild
# of a manager here, and which describe expected behaviour: demoted to DEBUG.
_EXPECTED_MESSAGES = ("Given directory is read only", "No jax.Array in TypeHandlerRegistry")


def _abandoned(exc: BaseException | None) -> bool:
    """True when ``exc`` (or an exception it chains from) is jaxft's SaveAbandoned."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, SaveAbandoned):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class _ExpectedFilter(logging.Filter):
    """Demotes Orbax's expected warnings, and the tracebacks its background threads log for a
    save that jaxft abandoned on purpose (a member died), to DEBUG one-liners."""

    def filter(self, record: logging.LogRecord) -> bool:
        abandoned = record.exc_info is not None and _abandoned(record.exc_info[1])
        if abandoned or any(m in str(record.msg) for m in _EXPECTED_MESSAGES):
            if abandoned:
                record.msg = f"{record.getMessage()} (abandoned on purpose: {record.exc_info[1]})"
                record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


logging.getLogger("absl").addFilter(_ExpectedFilter())

STATE_ITEM = "state"  # the one item of a jaxft checkpoint (Composite args)
TMP_SUFFIX = ocp.path.step.TMP_DIR_SUFFIX  # ".orbax-checkpoint-tmp": a save not published yet

# Orbax barrier names (orbax-checkpoint 0.12.x; item 4 of the module docstring).
COMMIT_KEY = "async_commit_complete"  # after the primary published (background thread)
FINALIZE_KEY = "ThreadSaveMultiHostValueHolder:set_value_start"  # save-in-progress flag (2nd: finalize)


# -- 1. replicated numpy arrays, written by the primary -----------------------------------------

class PrimaryNumpyHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's ``NumpyHandler`` (same format), writing from ``primary_host``.

    Orbax's own handler writes replicated numpy arrays only on ``process_index() == 0``;
    with process 0 dead that would publish a checkpoint without data. ``before_commit``
    runs after the writes and before the handler's commit future resolves, i.e. before
    Orbax writes the step metadata and publishes.
    """

    def __init__(self, primary_host: int, before_commit: Callable[[], None] | None = None):
        super().__init__(deepcopy_host_arrays=False)  # our snapshot is already private
        self._primary = primary_host
        self._before_commit = before_commit

    # Private: overrides NumpyHandler._background_serialize (the only place its writer is
    # chosen), with the same write spec as Orbax's; see item 1 of the module docstring.
    async def _background_serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        writes = []
        is_primary = process_index() == self._primary
        for value, info, arg in zip(values, infos, args):
            await info.await_path_creation()
            spec = _ocp_ts_utils.build_array_write_spec(
                info=info, arg=arg, global_shape=value.shape, local_shape=value.shape,
                dtype=value.dtype, use_ocdbt=info.is_ocdbt_checkpoint,
                process_index=_ocp_ocdbt_utils.get_process_index_for_subdir(
                    use_ocdbt=info.is_ocdbt_checkpoint,
                    override_ocdbt_process_id=self._override_ocdbt_process_id),
                metadata_key=self._metadata_key)
            if is_primary:
                writes.append(self._open_and_write(value, spec.json, info.ts_context))
        await asyncio.gather(*writes)
        if is_primary and self._before_commit is not None:
            await asyncio.to_thread(self._before_commit)


# -- 2. the bound of Orbax's blocking barriers ----------------------------------------------

def set_barrier_timeout(seconds: float) -> None:
    """Bound Orbax's blocking barriers (``sync_global_processes``; default 300 s).

    Private: ``_DEFAULT_BARRIER_TIMEOUT`` is what ``multihost.coordination_timeout()``
    returns; no option sets it (item 2 of the module docstring). Process-wide.
    """
    _ocp_multihost._DEFAULT_BARRIER_TIMEOUT = max(1, int(seconds))


def barrier_timeout() -> int:
    """The bound Orbax's blocking barriers use now (seconds)."""
    return int(_ocp_multihost.coordination_timeout())


# The SaveBarrier of the save in its blocking phase (one at a time per process). Process-wide,
# not per thread: Orbax runs some blocking barriers in a helper thread (``create_tmp_directory:pre``
# of ``atomicity.create_all``, awaited by the saving thread); per thread, a member that died there
# held the others for Timeouts.save_barrier (60 s, seen in a chaos run).
_blocking: list[SaveBarrier] = []


@contextlib.contextmanager
def blocking_barriers(barrier: SaveBarrier) -> Iterator[None]:
    """While inside, Orbax's blocking barriers over ``barrier``'s processes, in any thread, go
    through ``barrier`` (item 6 of the module docstring)."""
    original = _ocp_multihost.get_barrier_sync_fn
    if not getattr(original, "_jaxft", False):
        def get_barrier_sync_fn(*, processes=None):
            current = _blocking[-1] if _blocking else None
            if current is not None and processes is not None and set(processes) == set(current.processes):
                return current
            return original(processes=processes)

        get_barrier_sync_fn._jaxft = True  # type: ignore[attr-defined]
        _ocp_multihost.get_barrier_sync_fn = get_barrier_sync_fn
    _blocking.append(barrier)
    try:
        yield
    finally:
        _blocking.remove(barrier)


# -- 3. per-life awaitable-signal keys --------------------------------------------------------

_SIGNAL_PREFIX_SET = False


def private_signal_keys() -> None:
    """Give this process life its own Orbax "awaitable signal" keys (once per process).

    Orbax keys those signals in the coordination service by a per-process operation
    counter. The service outlives the workers here, so a restarted process would count
    from 1 again and meet the keys an abandoned save of a dead process left behind (a
    stale "directory created" signal, or a contract naming a signal never sent). jaxft
    creates step directories synchronously (``create_directories_asynchronously=False``),
    so no signal needs to cross processes; a unique prefix keeps each life's keys apart.
    Private: a class attribute of ``_src.futures.future`` (item 3 of the module docstring).
    """
    global _SIGNAL_PREFIX_SET
    if not _SIGNAL_PREFIX_SET:
        _ocp_future.AwaitableSignalsContract.awaitable_signals_contract_prefix = (
            f"awaitable_signals_contract_jaxft_{os.getpid()}_{os.urandom(4).hex()}")
        _SIGNAL_PREFIX_SET = True


def signal_prefix() -> str:
    """The awaitable-signal key prefix Orbax uses now."""
    return _ocp_future.AwaitableSignalsContract.awaitable_signals_contract_prefix


# -- 4. the background-phase barrier ----------------------------------------------------------

class SaveBarrier(kv.KVBarrier):
    """:class:`jaxft.worker.kv.KVBarrier` as the ``AsyncOptions.barrier_sync_fn`` of one save.

    Gives up with :class:`~jaxft.errors.SaveAbandoned`. Knows two Orbax barrier names
    (item 4 of the module docstring): passing ``async_commit_complete`` means the primary
    published; reaching ``ThreadSaveMultiHostValueHolder:set_value_start`` a second time
    without having passed it means this process's background phase failed (Orbax's
    finalize thread resets its "save in progress" value in a ``finally``), which it
    announces at once: peers must not wait for us until their timeout. ``lives`` (the
    commit's member map, process -> incarnation) lets it give up on a member that died
    before its first barrier of the save without the launcher's records (:mod:`jaxft.worker.lives`).
    """

    abandoned_error = SaveAbandoned

    def __init__(self, namespace: str, processes: Sequence[int], me: int, cancel, *, timeouts: Timeouts,
                 lives: Mapping[int, int] | None = None):
        super().__init__(namespace, processes, me, cancel, timeouts=timeouts, what="save",
                         dead_after="save_dead_after", unknown_after="save_barrier", timeout_name="save",
                         lives=lives)
        self.committed = False  # passed Orbax's "async_commit_complete" barrier

    def _arriving(self, key: str, n: int) -> None:
        if FINALIZE_KEY in key and n >= 1 and not self.committed:
            why = f"process {self.me}: background phase failed before the commit barrier"
            self.abandon(why)
            raise SaveAbandoned(f"barrier {key}: {why}")

    def _passed(self, key: str, n: int) -> None:
        if COMMIT_KEY in key:
            self.committed = True


# -- managers -----------------------------------------------------------------------------------

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


# -- 5. and helpers -----------------------------------------------------------------------------

def close_quietly(mgr) -> None:
    """Close ``mgr``; if that raises (a failed save re-raises in ``close``), release its
    checkpointer anyway. Private: ``CheckpointManager._checkpointer`` (item 5)."""
    try:
        mgr.close()
    except BaseException:  # noqa: BLE001 - the failed save is already reported
        try:
            mgr._checkpointer.close()
        except BaseException:  # noqa: BLE001
            pass


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


def is_finalized(path: str) -> bool:
    """Whether ``path`` is a published (finalized) Orbax step directory."""
    try:
        return os.path.isdir(path) and bool(ocp.path.step.is_path_finalized(path))
    except Exception:  # noqa: BLE001
        return False

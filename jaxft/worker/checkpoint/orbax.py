"""The Orbax shim: the only module of jaxft that touches Orbax internals.

Everything else in :mod:`jaxft.worker.checkpoint` uses Orbax's public API
(:mod:`~jaxft.worker.checkpoint.managers` builds the managers) and reaches the internals
only through this module's names. Written against ``orbax-checkpoint`` 0.12.x (checked on
import, before Orbax itself is imported); ``tests/test_checkpoint.py`` checks the behaviour
behind each internal used here and fails loudly when one moves.

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
   the primary published), ``async_write_complete`` (every member's writes done, before the
   primary publishes) and ``ThreadSaveMultiHostValueHolder:set_value_start`` (the
   manager's save-in-progress flag, reset in a ``finally`` of ``_finalize``):
   :class:`SaveBarrier` recognises them so that a process whose background phase failed
   says so at once instead of letting its peers wait until their timeout, and fires the
   ``before-publish`` fault point once the writes are done. Replace with an error callback
   of the async checkpointer (or a barrier fn that is told failures).
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
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

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

import orbax.checkpoint as ocp  # (the other modules take ``ocp`` from here: imported once checked)

# Private (see the module docstring, items 1-3).
from orbax.checkpoint._src.futures import future as _ocp_future
from orbax.checkpoint._src.multihost import multihost as _ocp_multihost
from orbax.checkpoint._src.serialization import ocdbt_utils as _ocp_ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as _ocp_ts_utils
from orbax.checkpoint.multihost import process_index

from jaxft.errors import SaveAbandoned
from jaxft.timeouts import Timeouts
from jaxft.worker import kv

# Orbax barrier names (orbax-checkpoint 0.12.x; item 4 of the module docstring).
COMMIT_KEY = "async_commit_complete"  # after the primary published (background thread)
WRITTEN_KEY = "async_write_complete"  # every member's writes done, before the primary publishes
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

# A save's barriers: a member is dead once its heartbeat stalls Timeouts.save_dead_after, or when
# it reached none of them within Timeouts.save_barrier; the background phase is bounded by .save.
SAVE_BARRIER = kv.BarrierOptions(what="save", dead_after="save_dead_after", unknown_after="save_barrier",
                                 timeout_name="save")

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
                 lives: Mapping[int, int] | None = None, written: Callable[[], None] | None = None):
        super().__init__(namespace, processes, me, cancel, timeouts=timeouts, options=SAVE_BARRIER, lives=lives)
        self.committed = False  # passed Orbax's "async_commit_complete" barrier
        self.written = False  # passed "async_write_complete": only the primary's publish is left
        self._written = written  # called then (a fault point)

    def _arriving(self, key: str, n: int) -> None:
        if FINALIZE_KEY in key and n >= 1 and not self.committed:
            why = f"process {self.me}: background phase failed before the commit barrier"
            self.abandon(why)
            raise SaveAbandoned(f"barrier {key}: {why}")

    def _passed(self, key: str, n: int) -> None:
        if COMMIT_KEY in key:
            self.committed = True
        elif WRITTEN_KEY in key:
            self.written = True
            if self._written is not None:
                self._written()


# -- 5. a manager's checkpointer, released when close() re-raises ------------------------------

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


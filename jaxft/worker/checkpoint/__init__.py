"""Orbax async checkpoints by the live set, and a cold restart when every process dies.

* :mod:`~jaxft.worker.checkpoint.layout`: what a checkpoint holds, and its SHA-256.
* :mod:`~jaxft.worker.checkpoint.orbax`: the Orbax shim (the only module touching Orbax internals).
* :mod:`~jaxft.worker.checkpoint.managers`: the Orbax managers a save or a read uses (public API).
* :mod:`~jaxft.worker.checkpoint.orbax_logs`: Orbax's log lines about what jaxft does on purpose, at DEBUG.
* :mod:`~jaxft.worker.checkpoint.store`: :class:`CheckpointStore`: async saves by any live subset,
  validated restores, quarantine of broken checkpoints.
* :mod:`~jaxft.worker.checkpoint.inflight`: a save in flight and the watcher that logs its outcome.
* :mod:`~jaxft.worker.checkpoint.elastic`: :class:`ElasticCheckpointer`, the trainer's commit hook.

Importing this package imports Orbax (slow): do it before ``jaxft.initialize()``.
"""

from jaxft.errors import CheckpointError, CheckpointMismatch, CheckpointRejected, SaveAbandoned
from jaxft.worker.checkpoint.elastic import ElasticCheckpointer, resolve_directory
from jaxft.worker.checkpoint.layout import FORMAT, flatten_state, state_checksum
from jaxft.worker.checkpoint.store import CheckpointStore, Restored

__all__ = [
    "FORMAT", "CheckpointError", "CheckpointMismatch", "CheckpointRejected", "CheckpointStore",
    "ElasticCheckpointer", "Restored", "SaveAbandoned", "flatten_state", "resolve_directory", "state_checksum",
]

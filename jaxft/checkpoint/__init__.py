"""Orbax async checkpoints by the live set, and a cold restart when every process dies.

* :mod:`~jaxft.checkpoint.layout`: what a checkpoint holds, and its SHA-256.
* :mod:`~jaxft.checkpoint.orbax`: the Orbax adapter (the only module touching Orbax internals).
* :mod:`~jaxft.checkpoint.store`: :class:`CheckpointStore`: async saves by any live subset,
  validated restores, quarantine of broken checkpoints.
* :mod:`~jaxft.checkpoint.elastic`: :class:`ElasticCheckpointer`, the trainer's commit hook.

Importing this package imports Orbax (slow): do it before ``jaxft.initialize()``.
"""

from jaxft.checkpoint.elastic import ElasticCheckpointer, resolve_directory
from jaxft.checkpoint.layout import FORMAT, flatten_state, state_checksum
from jaxft.checkpoint.store import CheckpointStore, Restored
from jaxft.errors import CheckpointError, CheckpointMismatch, CheckpointRejected, SaveAbandoned

__all__ = [
    "FORMAT", "CheckpointError", "CheckpointMismatch", "CheckpointRejected", "CheckpointStore",
    "ElasticCheckpointer", "Restored", "SaveAbandoned", "flatten_state", "resolve_directory", "state_checksum",
]

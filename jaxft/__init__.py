"""jaxft: multi-controller JAX training that survives process failures.

The light modules (launcher, coordinator, faults, events, runtime) import eagerly; the
ones that pull in jax, optax or Orbax load on first use of one of their names, so the
``jaxft`` command starts fast.
"""

import importlib

from jaxft.coordinator import Coordinator, CoordinatorError
from jaxft.events import EventLog, read_events
from jaxft.faults import FaultInjector, FaultRule, FaultSpecError, parse_rules
from jaxft.launcher import LaunchConfig, LaunchError, Launcher
from jaxft.runtime import InitializeError, Runtime, initialize

__version__ = "0.1.0"

_LAZY = {
    "jaxft.data": ("GlobalBatches", "Layout", "shard_batch"),
    "jaxft.membership": ("ElasticGroup", "Members", "StepFailed"),
    "jaxft.trainer": ("ConsistencyError", "ElasticTrainer", "StepRecord", "TrainState", "make_train_step"),
    "jaxft.transfer": ("broadcast_tree", "check_consistent", "tree_norm", "tree_sha256"),
    "jaxft.checkpoint": ("CheckpointError", "CheckpointMismatch", "CheckpointRejected", "CheckpointStore",
                         "ElasticCheckpointer", "Restored", "bench_async_vs_sync"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxft' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Coordinator", "CoordinatorError", "EventLog", "FaultInjector", "FaultRule", "FaultSpecError",
    "InitializeError", "LaunchConfig", "LaunchError", "Launcher", "Runtime", "initialize",
    "parse_rules", "read_events", *_WHERE,
]

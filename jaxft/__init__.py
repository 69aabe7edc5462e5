"""jaxft: multi-controller JAX training that survives process failures.

The light modules (errors, timeouts, launcher, coordinator, faults, events, runtime)
import eagerly; the ones that pull in jax, optax or Orbax load on first use of one of
their names, so the ``jaxft`` command starts fast. Type checkers see every name through
the ``TYPE_CHECKING`` imports below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jaxft.coordinator import Coordinator
from jaxft.errors import (BarrierAbandoned, BarrierTimeout, CheckpointError, CheckpointMismatch,
                          CheckpointRejected, ConfigError, ConsistencyError, CoordinatorError, Error,
                          FaultSpecError, InitializeError, LaunchError, RetryBudgetExceeded, SaveAbandoned,
                          StateMismatch, StepFailed, TimeoutsError, TooFewMembers, UncommittedSave,
                          UnsupportedOrbax)
from jaxft.events import EventLog, read_events
from jaxft.faults import FaultInjector, FaultRule, parse_rules
from jaxft.launcher import LaunchConfig, Launcher
from jaxft.runtime import Runtime, initialize
from jaxft.timeouts import Timeouts
from jaxft.types import PyTree

if TYPE_CHECKING:  # the lazy names below, for type checkers and IDEs
    from jaxft.checkpoint import CheckpointStore, ElasticCheckpointer, Restored
    from jaxft.data import GlobalBatches, Layout, shard_batch
    from jaxft.membership import ElasticGroup, Members
    from jaxft.rejoin import Rehydration
    from jaxft.grain_source import GrainBatches
    from jaxft.loop import ElasticLoop, StepRecord
    from jaxft.trainer import ElasticTrainer, TrainState, make_train_step
    from jaxft.transfer import broadcast_tree, check_consistent, save_tree, tree_norm, tree_sha256

__version__ = "0.1.0"

_LAZY = {
    "jaxft.data": ("GlobalBatches", "Layout", "shard_batch"),
    "jaxft.membership": ("ElasticGroup", "Members"),
    "jaxft.rejoin": ("Rehydration",),
    "jaxft.trainer": ("ElasticTrainer", "TrainState", "make_train_step"),
    "jaxft.loop": ("ElasticLoop", "StepRecord"),
    "jaxft.grain_source": ("GrainBatches",),
    "jaxft.transfer": ("broadcast_tree", "check_consistent", "save_tree", "tree_norm", "tree_sha256"),
    "jaxft.checkpoint": ("CheckpointStore", "ElasticCheckpointer", "Restored"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxft' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BarrierAbandoned", "BarrierTimeout", "CheckpointError", "CheckpointMismatch", "CheckpointRejected",
    "ConfigError", "ConsistencyError", "Coordinator", "CoordinatorError", "Error", "EventLog", "FaultInjector", "FaultRule", "FaultSpecError",
    "InitializeError", "LaunchConfig", "LaunchError", "Launcher", "PyTree", "RetryBudgetExceeded", "Runtime",
    "SaveAbandoned", "StateMismatch", "StepFailed", "Timeouts", "TimeoutsError", "TooFewMembers", "UncommittedSave", "UnsupportedOrbax", "initialize", "parse_rules", "read_events", *_WHERE,
]

"""jaxft: multi-controller JAX training that survives process failures.

The shared, light modules (errors, timeouts, faults, events, the coordinator) import
eagerly; the names of the two programs, the supervisor's and the worker's (which pulls in
jax, optax or Orbax), load on first use, so ``import jaxft`` brings in neither side, and the
``jaxft`` command starts fast. Type checkers see every name through the ``TYPE_CHECKING``
imports below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jaxft.coordinator import Coordinator
from jaxft.errors import (
    BarrierAbandoned,
    BarrierTimeout,
    CheckpointError,
    CheckpointMismatch,
    CheckpointRejected,
    ConfigError,
    ConsistencyError,
    CoordinatorError,
    Error,
    FaultSpecError,
    InitializeError,
    LaunchError,
    RetryBudgetExceeded,
    SaveAbandoned,
    StateMismatch,
    StepFailed,
    TimeoutsError,
    TooFewMembers,
    UncommittedSave,
    UnsupportedOrbax,
)
from jaxft.events import EventLog, read_events
from jaxft.faults import FaultInjector, FaultRule, parse_rules
from jaxft.timeouts import Timeouts
from jaxft.types import PyTree

if TYPE_CHECKING:  # the lazy names below, for type checkers and IDEs
    from jaxft.supervisor.launch_config import LaunchConfig, Output, Service, Shutdown, Topology
    from jaxft.supervisor.launcher import Launcher
    from jaxft.supervisor.restarts import RestartPolicy
    from jaxft.worker.checkpoint import CheckpointStore, ElasticCheckpointer, Restored
    from jaxft.worker.data import GlobalBatches, Layout, shard_batch
    from jaxft.worker.grain_source import GrainBatches
    from jaxft.worker.loop import ElasticLoop, StepRecord
    from jaxft.worker.members import Members
    from jaxft.worker.membership import ElasticGroup
    from jaxft.worker.options import (
        Batching,
        CheckpointOptions,
        InitOptions,
        LoopOptions,
        MeshStep,
        Reduction,
        RetryPolicy,
        parse_commit_every,
        valid_commit_every,
    )
    from jaxft.worker.rejoin import Rehydration
    from jaxft.worker.runtime import Runtime, initialize
    from jaxft.worker.train_step import make_train_step
    from jaxft.worker.trainer import ElasticTrainer, TrainState
    from jaxft.worker.transfer import broadcast_tree, check_consistent, save_tree, tree_norm, tree_sha256

__version__ = "0.1.0"

_LAZY = {
    "jaxft.supervisor.launcher": ("Launcher",),
    "jaxft.supervisor.launch_config": ("LaunchConfig", "Output", "Service", "Shutdown", "Topology"),
    "jaxft.supervisor.restarts": ("RestartPolicy",),
    "jaxft.worker.runtime": ("Runtime", "initialize"),
    "jaxft.worker.data": ("GlobalBatches", "Layout", "shard_batch"),
    "jaxft.worker.membership": ("ElasticGroup",),
    "jaxft.worker.members": ("Members",),
    "jaxft.worker.options": ("Batching", "CheckpointOptions", "InitOptions", "LoopOptions", "MeshStep", "Reduction",
                             "RetryPolicy", "parse_commit_every", "valid_commit_every"),
    "jaxft.worker.rejoin": ("Rehydration",),
    "jaxft.worker.trainer": ("ElasticTrainer", "TrainState"),
    "jaxft.worker.train_step": ("make_train_step",),
    "jaxft.worker.loop": ("ElasticLoop", "StepRecord"),
    "jaxft.worker.grain_source": ("GrainBatches",),
    "jaxft.worker.transfer": ("broadcast_tree", "check_consistent", "save_tree", "tree_norm", "tree_sha256"),
    "jaxft.worker.checkpoint": ("CheckpointStore", "ElasticCheckpointer", "Restored"),
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
    "ConfigError", "ConsistencyError", "Coordinator", "CoordinatorError", "Error", "EventLog",
    "FaultInjector", "FaultRule", "FaultSpecError", "InitializeError", "LaunchError",
    "PyTree", "RetryBudgetExceeded", "SaveAbandoned", "StateMismatch", "StepFailed",
    "Timeouts", "TimeoutsError", "TooFewMembers", "UncommittedSave", "UnsupportedOrbax",
    "parse_rules", "read_events", *_WHERE,
]

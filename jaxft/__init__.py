"""jaxft: multi-controller JAX training that survives process failures."""

from jaxft.coordinator import Coordinator, CoordinatorError
from jaxft.events import EventLog, read_events
from jaxft.data import GlobalBatches, Layout, shard_batch
from jaxft.faults import FaultInjector, FaultRule, FaultSpecError, parse_rules
from jaxft.membership import ElasticGroup, Members, StepFailed
from jaxft.launcher import LaunchConfig, LaunchError, Launcher
from jaxft.runtime import InitializeError, Runtime, initialize
from jaxft.trainer import ConsistencyError, ElasticTrainer, TrainState, make_train_step
from jaxft.transfer import broadcast_tree, check_consistent, tree_norm, tree_sha256

__version__ = "0.1.0"

__all__ = [
    "ConsistencyError", "Coordinator", "ElasticTrainer", "GlobalBatches", "Layout", "TrainState", "broadcast_tree", "check_consistent", "make_train_step", "shard_batch", "tree_norm", "tree_sha256", "ElasticGroup", "Members", "StepFailed", "CoordinatorError", "EventLog", "FaultInjector", "FaultRule", "FaultSpecError",
    "InitializeError", "LaunchConfig", "LaunchError", "Launcher", "Runtime", "initialize",
    "parse_rules", "read_events",
]

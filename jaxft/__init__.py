"""jaxft: multi-controller JAX training that survives process failures."""

from jaxft.coordinator import Coordinator, CoordinatorError
from jaxft.events import EventLog, read_events
from jaxft.faults import FaultInjector, FaultRule, FaultSpecError, parse_rules
from jaxft.membership import ElasticGroup, Members, StepFailed
from jaxft.launcher import LaunchConfig, LaunchError, Launcher
from jaxft.runtime import InitializeError, Runtime, initialize

__version__ = "0.1.0"

__all__ = [
    "Coordinator", "ElasticGroup", "Members", "StepFailed", "CoordinatorError", "EventLog", "FaultInjector", "FaultRule", "FaultSpecError",
    "InitializeError", "LaunchConfig", "LaunchError", "Launcher", "Runtime", "initialize",
    "parse_rules", "read_events",
]

"""Every bound jaxft waits under, in one settings object.

A :class:`Timeouts` travels from ``jaxft launch --timeout NAME=SECONDS`` (or
``jaxft.initialize(timeouts=...)``) through the worker's environment to each wait, and
every wait that gives up names the setting that bounded it (:meth:`Timeouts.describe`),
so a user knows which knob to turn.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, MutableMapping

from jaxft import protocol
from jaxft.errors import TimeoutsError


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds each kind of wait may take before jaxft gives up on it.

    Attributes:
      heartbeat: the coordination service declares a process dead after this long
        without heartbeats.
      collective: a CPU (gloo) collective with a dead peer fails after this long.
      initialization: connecting to the coordination service.
      barrier: the watchdog bound of a membership barrier (entering or leaving a step);
        a process that waits longer exits rather than hang.
      step: the floor of the step deadline: a member stuck this long (and at least 20x
        the recent median step) while others wait for it is hung (see jaxft.worker.hang).
        The 10 s default removes a hung member of a 50 ms step within 200 steps' worth;
        raise it where legitimate pauses between steps run longer (or wrap them in
        ``group.busy()``).
      stuck: a member still inside a step this long (and at least 2x the recent median step)
        after the launcher recorded another member's death during it, while others wait for
        it, leaves and rejoins (gloo can leave a send pending until ``collective``; see jaxft.worker.hang).
      setup: the step deadline during set-up, a compile for a new mesh, a rejoin.
      reset: the barrier of the CPU data-plane rebuild when the live set gains members.
      save_barrier: each blocking Orbax barrier of a save, and how long a save waits for
        a member that never reached any of its barriers.
      save: the background phase (writes and its barriers) of one async save.
      save_dead_after: a save member whose checkpoint heartbeat stalls this long is dead.
      topology: the CPU backend's topology exchange at start-up (rounded up to minutes,
        the unit jax takes).
      shutdown: the coordination service's shutdown barrier.
      admission: how long a ready joiner waits for the members to admit it.
    """

    heartbeat: float = 3.0
    collective: float = 5.0
    initialization: float = 60.0
    barrier: float = 600.0
    step: float = 10.0
    stuck: float = 0.5
    setup: float = 600.0
    reset: float = 60.0
    save_barrier: float = 60.0
    save: float = 600.0
    save_dead_after: float = 5.0
    topology: float = 120.0
    shutdown: float = 5.0
    admission: float = 600.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TimeoutsError(f"timeout {f.name} must be a number of seconds, got {value!r}")
            if f.name in ("heartbeat", "collective") and not value >= 1:  # jax takes whole seconds here
                raise TimeoutsError(f"timeout {f.name} must be >= 1 second, got {value}")
            if not value > 0:
                raise TimeoutsError(f"timeout {f.name} must be > 0 seconds, got {value}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: float | None) -> Timeouts:
        """A copy with the given fields changed (None values are ignored)."""
        unknown = set(changes) - set(self.names())
        if unknown:
            raise TimeoutsError(f"unknown timeout(s) {sorted(unknown)}; known: {', '.join(self.names())}")
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def updated(self, specs: Mapping[str, str] | list[str] | str) -> Timeouts:
        """A copy with ``NAME=SECONDS`` settings applied (a list, or one comma-separated string)."""
        if isinstance(specs, str):
            specs = [s for s in specs.split(",") if s.strip()]
        items = specs.items() if isinstance(specs, Mapping) else [_split(s) for s in specs]
        changes: dict[str, float] = {}
        for name, raw in items:
            name = name.strip().replace("-", "_")
            try:
                changes[name] = float(raw)
            except (TypeError, ValueError):
                raise TimeoutsError(f"timeout {name}={raw!r} is not a number of seconds") from None
        return self.replace(**changes)

    def encode(self) -> str:
        """``name=value,...`` for the worker environment (:data:`protocol.TIMEOUTS`)."""
        return ",".join(f"{f}={getattr(self, f):g}" for f in self.names())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Timeouts:
        """The settings ``jaxft launch`` handed down (defaults where absent)."""
        t = cls()
        raw = environ.get(protocol.TIMEOUTS)
        if raw:
            t = t.updated(raw)
        # The older single-purpose variables still win where set (they are what users set by hand).
        for name, var in (("heartbeat", protocol.HEARTBEAT_TIMEOUT), ("collective", protocol.COLLECTIVE_TIMEOUT)):
            if environ.get(var):
                t = t.updated({name: environ[var]})
        return t

    def export(self, environ: MutableMapping[str, str]) -> None:
        """Write these settings into a child's environment."""
        environ[protocol.TIMEOUTS] = self.encode()
        environ[protocol.HEARTBEAT_TIMEOUT] = f"{int(self.heartbeat)}"
        environ[protocol.COLLECTIVE_TIMEOUT] = f"{int(self.collective)}"

    def describe(self, name: str) -> str:
        """``"Timeouts.reset=60 s (set with jaxft launch --timeout reset=SECONDS)"``."""
        return (f"Timeouts.{name}={getattr(self, name):g} s (set with jaxft launch --timeout {name}=SECONDS "
                f"or jaxft.initialize(timeouts=...))")


def _split(spec: str) -> tuple[str, str]:
    name, sep, value = spec.partition("=")
    if not sep or not name.strip():
        raise TimeoutsError(f"timeout setting {spec!r} is not NAME=SECONDS; names: {', '.join(Timeouts.names())}")
    return name, value


_current: Timeouts | None = None


def current() -> Timeouts:
    """The settings of this process: those ``initialize()`` received, else from the environment."""
    return _current if _current is not None else Timeouts.from_env()


def set_current(timeouts: Timeouts) -> None:
    """Make ``timeouts`` this process's settings (called by ``jaxft.initialize``)."""
    global _current
    _current = timeouts

"""Every error jaxft raises, under one base class :class:`Error`.

Each class keeps the built-in base it had before (``RuntimeError`` or ``ValueError``),
so ``except RuntimeError`` code keeps working; ``except jaxft.Error`` catches them all.
They live in this light module (no jax import) so that the CLI and the launcher can
name them without loading jax.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class Error(Exception):
    """Base of every jaxft error."""


# A worker that stops on a ConfigError exits with this code (sysexits' EX_CONFIG), and
# the launcher does not restart it: a restart would only repeat the error.


class ConfigError(Error):
    """A configuration error (a checkpoint of another model, a file where a directory is
    needed, ...): not a fault. Uncaught in a worker, it ends the worker with
    :data:`jaxft.protocol.EXIT_CONFIG_ERROR` and a one-line message, and the launcher does not retry it."""


class InitializeError(Error, RuntimeError):
    """``jaxft.initialize`` was called wrongly or could not connect."""


class CoordinatorError(Error, RuntimeError):
    """The coordination service could not be started."""


class LaunchError(Error, ValueError):
    """Bad launcher arguments."""


class FaultSpecError(Error, ValueError):
    """A fault spec that cannot be parsed."""


class TimeoutsError(Error, ValueError):
    """A bad timeout setting (unknown name, not a number, out of range)."""


class BarrierTimeout(Error, TimeoutError):
    """A barrier of the coordination service outlasted the timeout that bounds it."""


class BarrierAbandoned(Error, RuntimeError):
    """A barrier gave up because a process it waited for is known to be dead."""


class StepFailed(Error, RuntimeError):
    """A step failed on every member because processes died or restarted during it."""

    def __init__(self, failed: Iterable[int], cause: BaseException | None, noticed: Mapping[int, str] | None = None):
        self.failed = tuple(sorted(set(failed)))
        self.cause = cause
        # failed process -> how this member knew it was dead (those not in it: the service said)
        self.noticed = {p: why for p, why in (noticed or {}).items() if p in self.failed}
        why = f"{type(cause).__name__}: {str(cause).splitlines()[0][:200]}" if cause else "membership changed"
        super().__init__(f"step failed; processes {list(self.failed)} failed ({why})")


class TooFewMembers(Error, RuntimeError):
    """Fewer live members than the run's minimum: steps are not committed, and after a
    bound the run stops instead of training on with too few."""


class RetryBudgetExceeded(Error, RuntimeError):
    """One step failed more times in a row than the run allows."""


class ConsistencyError(Error, RuntimeError):
    """Members hold different parameters: a bug or silent corruption, never ignored."""

    def __init__(self, step: int, processes: list[int]):
        self.step, self.processes = step, processes
        super().__init__(f"params diverged at step {step}: processes {processes} disagree with the majority")


class CheckpointError(Error, RuntimeError):
    """A checkpoint cannot be used."""


class CheckpointRejected(CheckpointError):
    """A finalized checkpoint that does not read back as complete and intact."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"checkpoint {path} rejected: {reason}")


class CheckpointDirectoryError(CheckpointError, ConfigError):
    """The checkpoint directory cannot be used (a regular file, not creatable, ...)."""


class UnsupportedOrbax(CheckpointError, ConfigError):
    """The installed orbax-checkpoint is outside the releases jaxft's Orbax adapter supports
    (raised on its import, before any save; a worker stops with one line, not restarted)."""


class CheckpointMismatch(CheckpointError, ConfigError):
    """An intact checkpoint of a different model (other tree structure, shapes or dtypes)."""


class StateMismatch(ConfigError):
    """A process's state has another structure than the running members' (another model or
    optimizer): it is refused before any state moves, and exits as a configuration error."""


class UncommittedSave(CheckpointError, ConfigError):
    """``save()`` called while the loop holds steps it ran but has not committed (``commit_every``):
    they may still be undone, so they are never saved. A program error, not a fault: a worker
    stops on it (exit 78) rather than repeat it life after life."""


class SaveAbandoned(BarrierAbandoned):
    """A save gave up waiting for a member that died."""

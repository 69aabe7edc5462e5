"""The next step's program, started before this step commits (``LoopOptions(pipeline=True)``).

As soon as step k's program has ended, step k+1's starts on step k's uncommitted output, so
that step k's commit query and bookkeeping run while the devices compute. What commits is
unchanged: the early program is taken over only by the same step on the same mesh and state;
if step k does not commit, it is left (on CPU this process's data plane is broken so that it
ends at once; the retry rebuilds it). Every member decides alike whether to start it, from the
step's agreed votes (:func:`jaxft.core.step.runs_ahead`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

from jaxft.types import PyTree
from jaxft.worker import breaker
from jaxft.worker import runner as runner_lib

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Ahead:
    """A step's program started before the step ahead of it committed."""

    step: int  # the step it runs
    worker: Any  # its call in the StepRunner
    mesh: Mesh
    inputs: PyTree  # the global state it started from: the previous step's output
    result: tuple | None = None  # ("done", outputs) or ("error", exception), once collected
    error: Exception | None = None  # why this member ran it on placeholders (its inputs failed)


class Pipeline:
    """One loop's early program, at most one at a time."""

    def __init__(self, runner: runner_lib.StepRunner, process_id: int, cpu_multiprocess: Callable[[], bool]):
        self._runner, self.process_id, self._cpu_multiprocess = runner, process_id, cpu_multiprocess
        self._ahead: Ahead | None = None
        self.started_early = 0  # committed steps whose program started before the last commit
        self.left_early = 0  # programs started early and left: the step before them failed

    def start(self, step: int, mesh: Mesh, inputs: PyTree, job: Callable, error: Exception | None) -> None:
        """Run ``job`` (step ``step``'s program on ``inputs``, this step's output) now."""
        self._ahead = Ahead(step, self._runner.start(job), mesh, inputs, error=error)

    def _collect(self, ahead: Ahead) -> None:
        """Wait for ``ahead``'s program to end; keep what it gave (or raised)."""
        if ahead.result is None:
            try:
                ahead.result = ("done", self._runner.wait(ahead.worker))
            except Exception as e:  # noqa: BLE001 - handed to the step that takes it over
                ahead.result = ("error", e)

    def take(self, step: int, mesh: Mesh, usable_inputs: Callable[[PyTree], bool], changed: bool) -> tuple | None:
        """``(outputs, error)`` of step ``step``'s program if it was started early on ``mesh`` and
        on inputs the caller still holds (``usable_inputs``), the members unchanged (``changed``:
        a rebuild or a sync); otherwise the early program (if any) is waited for and dropped."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        self._collect(ahead)
        assert ahead.result is not None  # (collected)
        if ahead.step != step or ahead.mesh is not mesh or changed or not usable_inputs(ahead.inputs):
            logger.debug("process %d: dropped step %d's early program", self.process_id, ahead.step)
            return None
        kind, value = ahead.result
        if kind == "error":
            raise value
        self.started_early += 1
        return value, ahead.error

    def settle(self, drop: bool = False) -> None:
        """Wait for the early program to end (keeping its result for the step that takes it over;
        ``drop``: forgetting it): afterwards nothing of the loop runs on the devices."""
        if self._ahead is not None:
            self._collect(self._ahead)
        if drop:
            self._ahead = None

    def leave(self, why: str) -> None:
        """The step before the early one did not commit: leave that program. On CPU its collective
        may wait on a member that died, so this process's data plane (which the retry rebuilds
        anyway) is broken to end it now rather than at gloo's timeout."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.result is not None:
            return
        self.left_early += 1
        if self._runner.abandon(why):
            if self._cpu_multiprocess():
                breaker.break_data_plane()
        else:  # it had ended: collect it (the runner hands each call's result once)
            self._collect(ahead)

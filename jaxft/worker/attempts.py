"""How an attempt at a step ends, and what a commit reports (:class:`StepRecord`).

:class:`~jaxft.ElasticLoop` runs each attempt inside the group's step; besides a commit or a
:class:`~jaxft.errors.StepFailed`, an attempt leaves the step by one of the exceptions here,
each decided alike by every member (from the members they share or the step's agreed votes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxft.core import step as step_core
from jaxft.core import votes as votes_lib
from jaxft.types import PyTree
from jaxft.worker import rejoin, transfer
from jaxft.worker.members import Members


class Skip(Exception):
    """Leave a step without committing: too few members (all members agree on it), or a spare
    enters first (``spare``: fewer members than the width, and a spare ready in the agreed
    votes, :mod:`jaxft.core.spares`); the votes summed alone (ready admission), for the joiners
    they wait for."""

    def __init__(self, verdict: votes_lib.Verdict | None, spare: bool = False):
        super().__init__("a spare enters first" if spare else "too few members")
        self.verdict, self.spare = verdict, spare


class VotedFail(Exception):
    """Leave a step without committing: a member voted ``fail`` (it could not build its inputs)."""

    def __init__(self, error: Exception | None):
        super().__init__(str(error) if error is not None else "a member could not build its inputs")
        self.error = error  # this member's own error, None if another member's

    @property
    def why(self) -> str:
        if self.error is None:
            return "another member could not build its inputs"
        return f"{type(self.error).__name__}: {self.error}"


class Desync(Exception):
    """Leave a step without committing: the members ran different steps (their step votes differ)."""


class Reached(Exception):
    """Leave a step without running it: entering it restored the run's last step (a restore
    put off to a cold start, :meth:`jaxft.ElasticGroup.on_cold_start`), so nothing is left to train."""


@dataclasses.dataclass
class StepRecord:
    """What one commit produced (passed to ``on_commit``)."""

    step: int
    loss: float | None
    members: tuple[int, ...]
    generation: int
    incarnations: dict[int, int] = dataclasses.field(default_factory=dict)  # process -> service incarnation
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Ran:
    """What one attempt's program gave (inside the group's step)."""

    step: int
    members: Members
    new_global: PyTree
    metrics: dict[str, float]
    verdict: votes_lib.Verdict | None
    rehydrated: rejoin.Rehydration | None
    seconds: float
    new_state: PyTree = dataclasses.field(init=False, default=None)  # the local copy of new_global
    defer: bool = dataclasses.field(init=False, default=False)  # its commit is left to a later step's
    ended: float = dataclasses.field(init=False, default=0.0)  # when the attempt's body ended (monotonic)

    def record(self, generation: int) -> StepRecord:
        """The step's record for ``on_commit``, in the members' ``generation``."""
        m = self.members
        return StepRecord(self.step, self.metrics.get("loss"), m.process_ids, generation, dict(m.incarnations),
                          self.metrics)


def read_outputs(host: tuple, voting: bool, num_devices: int,
                 local_error: Exception | None) -> tuple[dict, votes_lib.Verdict | None]:
    """A step program's host outputs as ``(metrics, the agreed votes' verdict)``; raises
    :class:`VotedFail` or :class:`Desync` when the votes say the step fails everywhere."""
    if not voting:
        (metrics,) = host
        return metrics, None
    metrics, agreed = host
    verdict = votes_lib.read(np.asarray(agreed), num_devices)
    failure = step_core.verdict_failure(verdict)
    if failure == "fail":
        raise VotedFail(local_error)
    if failure == "desync":
        raise Desync
    return metrics, verdict


def final_fields(loop: Any, params: PyTree | None) -> dict:
    """The ``final`` event's fields (see :meth:`jaxft.ElasticLoop.log_final`)."""
    tree = params
    if tree is None:
        s = loop.state
        tree = s["params"] if isinstance(s, dict) and "params" in s else getattr(s, "params", s)
    o, ex = loop.options, loop.executor
    return {"step": loop.step, "params_sha256": transfer.tree_sha256(tree), "params_norm": transfer.tree_norm(tree),
            "loss": loop.last_loss, "abandoned_programs": ex.runner.abandoned_total,
            **({"started_early": ex.pipeline.started_early, "left_early": ex.pipeline.left_early}
               if o.pipeline else {}),
            **({"deferred": loop.group.deferred, "rolled_back": loop.commits.rolled_back}
               if o.batches else {}),
            **({"replaced_backends_alive": dp.replaced_alive, "dead_pairs_disarmed": dp.dead_pairs.disarmed}
               if (dp := loop.group.data_plane).needs_reset else {})}

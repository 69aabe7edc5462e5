"""One member's atomic step, from its entry to commit or fail (ready admission).

A step is bracketed by two liveness queries over its members (:mod:`jaxft.core.liveness`):
the **entry** (who is in the step, with which life) and the **exit** (who is still there).
A member commits iff every member of the entry is in the exit answer with the same life and
its own body succeeded; the members all get the same exit answer, so they all decide alike.
In steady state the exit answer of step k is the entry of step k+1 (one query a step): an
entry query is made only on a process's first step, after a failed step, and when joiners
were admitted (it is where they meet the members).

:class:`MemberStep` is the state this needs between steps; the I/O side
(:class:`jaxft.worker.membership.ElasticGroup`) asks it what to do next and tells it what
happened, and ``tests/simulation.py`` drives the same object for N simulated processes.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Mapping


@dataclasses.dataclass(frozen=True)
class UseCommitted:
    """Enter the step over the last commit's exit answer: no query."""

    entry: Mapping[int, int]


@dataclasses.dataclass(frozen=True)
class QueryEntry:
    """Enter the step by a liveness query over ``pids`` (``expect``: joiners admitted into it).

    ``lives``: the life each member is expected with (the last exit answer's). An answer that
    names another life of a member is confirmed without it (:func:`jaxft.core.liveness.on_answer`):
    a dead member's ask, left in an open query over the same set, counts for its restarted
    life, which must enter by admission, never by completing the members' query."""

    pids: tuple[int, ...]
    expect: frozenset[int]
    lives: Mapping[int, int]


@dataclasses.dataclass(frozen=True)
class FirstStep:
    """This process's first step: join a running set (admission) or start cold with everyone."""


class Outcome(enum.Enum):
    COMMIT = "commit"  # every member of the entry is still there, and this member's body succeeded
    FAIL = "fail"  # a member's life ended during the step: nobody commits (StepFailed)
    ERROR = "error"  # nobody failed, but this member's body raised: its own error propagates


def failed_members(entry: Mapping[int, int], exit_answer: Mapping[int, int]) -> frozenset[int]:
    """The members of ``entry`` whose life is not in ``exit_answer`` (gone, or another life)."""
    return frozenset(p for p, life in entry.items() if exit_answer.get(p) != life)


def decide(entry: Mapping[int, int], exit_answer: Mapping[int, int], body_ok: bool) -> Outcome:
    """The step's outcome for one member (see the module docstring)."""
    if failed_members(entry, exit_answer):
        return Outcome.FAIL
    return Outcome.COMMIT if body_ok else Outcome.ERROR


@dataclasses.dataclass
class MemberStep:
    """What one member carries from step to step (ready admission)."""

    committed: dict[int, int] | None = None  # the last commit's exit answer: the next entry, or None
    barrier: dict[int, int] | None = None  # the next entry query's members and lives; None before the first step
    admitting: frozenset[int] = frozenset()  # joiners admitted at the last commit
    agreed: dict[int, int] | None = None  # the member map of the last committed step
    joining: bool = False  # admitted into a running set; until its first commit

    def plan_entry(self) -> UseCommitted | QueryEntry | FirstStep:
        """How to enter the next step."""
        if self.committed is not None and not self.admitting:
            return UseCommitted(dict(self.committed))
        if self.barrier is None:
            return FirstStep()
        return QueryEntry(tuple(sorted(set(self.barrier) | self.admitting)), self.admitting, dict(self.barrier))

    def entered(self, entry: Mapping[int, int]) -> None:
        """The step was entered over ``entry``: nothing is committed until it exits."""
        self.committed = None
        self.admitting = frozenset()
        self.barrier = dict(entry)

    def defer(self, entry: Mapping[int, int]) -> None:
        """The step's body succeeded and its commit is left to a later step's exit query (all
        of them or none: the members' next step meets any failure)."""
        self.agreed = dict(entry)
        self.committed = dict(entry)
        self.joining = False

    def exited(self, entry: Mapping[int, int], exit_answer: Mapping[int, int], body_ok: bool) -> Outcome:
        """The exit query answered ``exit_answer``: the outcome, and the state for the next step
        (a member whose life changed is no member: it enters again by admission, if ever)."""
        failed = failed_members(entry, exit_answer)
        self.barrier = {p: life for p, life in exit_answer.items() if p not in failed}
        outcome = decide(entry, exit_answer, body_ok)
        if outcome is Outcome.COMMIT:
            self.agreed = dict(entry)
            self.committed = dict(exit_answer)
            self.joining = False
        return outcome

    def admit(self, joiners: Collection[int]) -> None:
        """Joiners the members agreed on (at a commit) enter at the next step."""
        self.admitting = frozenset(joiners)

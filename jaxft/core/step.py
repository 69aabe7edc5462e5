"""What the members decide from a step's agreed votes, alike everywhere.

Each member votes its own conditions into the step's program (:mod:`jaxft.core.votes`); the
program sums them, and every decision that must be the same on every member is read from
that sum, never from a member's own view (:func:`own_votes` builds a member's part,
:func:`verdict_failure`, :func:`runs_ahead` and :func:`defers` read the sum).
"""

from __future__ import annotations

import dataclasses

from jaxft.core.votes import Verdict


@dataclasses.dataclass(frozen=True)
class OwnVotes:
    """One member's conditions for what follows step ``step`` (its vote row, bar admission)."""

    hold: bool  # admit nobody now (its run ends at this step)
    not_ahead: bool  # start no step before this one commits
    commit: bool  # commit this step now, not with a later one


def own_votes(step: int, target: int | None, *, pipeline: bool, next_quiet: bool, commit_every: int,
              stop_requested: bool, batch_full: bool | None = None) -> OwnVotes:
    """A member's votes for step ``step`` of a run to ``target`` (None: its end unknown).

    ``next_quiet``: no fault rule of this member can fire at step ``step + 1`` (a step started
    early must not change where a rule fires). The run's end is this member's own: a restart
    catching up in an earlier ``run()`` ends there, and makes every member commit, admit
    nobody and start nothing early at that step, as they all would at their own last step.
    ``batch_full``: with ``commit_every="auto"`` (:mod:`jaxft.core.batching`), whether this
    member's own batch is full with this step (None: the fixed ``commit_every``), which the
    caller also sets at a step at which a fault rule of this member may fire; an auto batch
    also ends before such a step, so the rules land where they would without batching (an
    ``in-commit`` or ``after-commit`` rule needs its step's own commit).
    """
    ends = target is not None and step + 1 >= target
    open_ended = target is None or ends  # a step starts early or defers only when the run's end is known
    not_ahead = open_ended or not pipeline or stop_requested or not next_quiet
    if batch_full is None:
        full = commit_every == 1 or (step + 1) % commit_every == 0
    else:
        full = batch_full or not next_quiet
    commit = open_ended or full or stop_requested
    return OwnVotes(hold=ends, not_ahead=not_ahead, commit=commit)


def verdict_failure(verdict: Verdict) -> str | None:
    """Why every member fails this step: ``"fail"`` (a member could not build its inputs and
    ran on placeholders), ``"desync"`` (the members ran different steps), or None."""
    if verdict.failed:
        return "fail"
    if not verdict.same_step:
        return "desync"
    return None


def runs_ahead(verdict: Verdict) -> bool:
    """Whether the next step's program may start before this step commits (``pipeline``):
    nobody joins (the members stay the same unless one fails) and no member objects."""
    return verdict.quiet and not verdict.not_ahead


def defers(verdict: Verdict, members_changed: bool) -> bool:
    """Whether this step leaves its commit to a later step's query (``commit_every``): nobody
    joins, the members did not just change (a rebuild, a joiner, a resync), nobody wants it now."""
    return verdict.quiet and not members_changed and not verdict.commit

"""When a loop gives up: the retry budget of ``run()``, as a state machine over attempt outcomes.

Each attempt at the next step ends in one of four ways, and :class:`RetryBudget` is told
which: it committed (:meth:`~RetryBudget.committed`), it ran and its commit is left to a later
step (``commit_every``, :meth:`~RetryBudget.pending`), too few members were alive to commit
(:meth:`~RetryBudget.too_few`), or it failed (:meth:`~RetryBudget.failed`). It answers with
what to do: go on, wait, or give up (and why). No clock, no I/O: the caller passes the time.

The rules:

* ``max_attempts`` failed attempts in a row at one step give up. The count restarts at a
  commit and when the step moves without one (a rejoin's rehydration or a restore moved it:
  a new step). A pending step is no progress: with ``commit_every`` a failure undoes the
  steps since the last commit, and those are run again, so counting from a pending step
  would never trip;
* too few members (``min_members``) for longer than the barrier bound gives up; a commit
  or a pending step ends that wait.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """Stop retrying: ``kind`` is ``"attempts"`` (the budget of failed attempts is spent) or
    ``"members"`` (too few members for too long)."""

    kind: str
    failures: int = 0


@dataclasses.dataclass
class RetryBudget:
    """The retry state of one ``run()`` (``max_attempts``: None is unbounded)."""

    max_attempts: int | None
    wait_bound_s: float
    failures: int = 0
    waiting_since: float | None = None
    at_step: int = 0  # the step the failures count against

    def committed(self, step: int) -> None:
        """A commit: the next step starts with a full budget."""
        self.failures, self.waiting_since, self.at_step = 0, None, step

    def pending(self) -> None:
        """A step ran; its commit is left to a later step's."""
        self.waiting_since = None

    def too_few(self, now: float) -> GiveUp | None:
        """Too few members to commit; nothing failed."""
        if self.waiting_since is None:
            self.waiting_since = now
        if now - self.waiting_since > self.wait_bound_s:
            return GiveUp("members")
        return None

    def failed(self, step: int) -> GiveUp | None:
        """An attempt at ``step`` failed everywhere."""
        if step != self.at_step:  # (a rehydration or a restore moved it: a new step)
            self.failures, self.at_step = 0, step
        self.failures += 1
        if self.max_attempts is not None and self.failures >= self.max_attempts:
            return GiveUp("attempts", self.failures)
        return None

"""Steps run but not committed yet (``LoopOptions(commit_every=N)``): one commit query for many.

A step whose commit is left to a later step's query (:func:`jaxft.core.step.defers`, decided
alike by every member) is kept here with what the last commit left (step, state, the last
step's outputs); the next query commits them all with its own step, or a failure undoes them
on every member (:meth:`PendingCommits.roll_back`) and they run again.
"""

from __future__ import annotations

from typing import Any


class PendingCommits:
    """The records of the steps run since the last commit, and the state to go back to."""

    def __init__(self) -> None:
        self.records: list[Any] = []  # StepRecords, in step order
        self._before: tuple | None = None  # (step, state, last outputs) as the last commit left them
        self.rolled_back = 0  # steps run, then undone because a later step of their commit failed

    def __len__(self) -> int:
        return len(self.records)

    def defer(self, record: Any, before: tuple) -> None:
        """Keep ``record`` uncommitted; ``before``: the loop's (step, state, last outputs) before
        it ran, kept for the first step left uncommitted only."""
        if not self.records:
            self._before = before
        self.records.append(record)

    def commit(self, record: Any) -> list[Any]:
        """The records a commit of ``record`` commits: those left pending, then it."""
        done, self.records, self._before = self.records + [record], [], None
        return done

    def roll_back(self) -> tuple[tuple, list[int]] | None:
        """Undo the pending steps: ``(what the last commit left, the steps undone)``, or None."""
        if not self.records:
            return None
        undone = [r.step for r in self.records]
        before, self.records, self._before = self._before, [], None
        self.rolled_back += len(undone)
        assert before is not None
        return before, undone

    def clear(self) -> None:
        """Forget the pending steps (a restore replaces the state)."""
        self.records, self._before = [], None

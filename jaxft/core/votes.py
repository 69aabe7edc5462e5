"""The votes a step's program carries: what every member must decide alike, agreed for free.

Each member adds a row of small integers to the step's own all-reduce (one per device it
holds, summed over the devices in float32: every count stays exact). The sum is part of the
step's output, so every member reads the same agreement, or the step failed everywhere and
nobody reads it. No coordination-service round trip is made for it.

A row is ``[P + EXTRA]`` int32 for ``P`` processes::

    [0, P)          admission: READY in a non-member's slot whose ready key this member saw,
                    HOLD in every non-member slot to admit nobody at this step
    P + FAIL        1: this member could not build its inputs (it ran the step on placeholders)
    P + NOT_AHEAD   1: this member lets no step start before this one commits (pipeline)
    P + COMMIT      1: this member wants this step committed now, not left to a later query
    P + STEP ...    the step number this member runs, one column per bit (STEP_BITS of them)

The program sums the rows (``jaxft.worker.loop.agreed_votes``). Decisions read from the
sum (:func:`read`) rest on what every member shares, never on a
member's own view, which is what keeps the members in step (a member one step ahead of the
others shows in the step bits, and the step fails everywhere instead of mixing two steps'
states in one all-reduce).
"""

from __future__ import annotations

import dataclasses

import numpy as np

READY = 1  # a member saw this joiner's ready key
HOLD = 1 << 20  # admit nobody: any admission sum >= HOLD has a hold in it (READY sums are <= devices)

FAIL, NOT_AHEAD, COMMIT, STEP = 0, 1, 2, 3  # offsets after the P admission slots
STEP_BITS = 40
EXTRA = STEP + STEP_BITS


def width(num_processes: int) -> int:
    """Columns of a vote row for ``num_processes`` processes."""
    return num_processes + EXTRA


def row(admission: np.ndarray, step: int, *, fail: bool = False, not_ahead: bool = False,
        commit: bool = False) -> np.ndarray:
    """One member's vote row ``[P + EXTRA]`` int32 (``admission``: ``[P]``, see the module docstring)."""
    if not 0 <= step < (1 << STEP_BITS):
        raise ValueError(f"step {step} out of range for the step votes")
    p = len(admission)
    out = np.zeros(width(p), np.int32)
    out[:p] = admission
    out[p + FAIL] = int(fail)
    out[p + NOT_AHEAD] = int(not_ahead)
    out[p + COMMIT] = int(commit)
    out[p + STEP:] = (step >> np.arange(STEP_BITS)) & 1
    return out


def empty(num_processes: int, step: int = 0) -> np.ndarray:
    """A row that votes for nothing (no joiner, no fail, free to run ahead and defer)."""
    return row(np.zeros(num_processes, np.int32), step)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the members agreed on in one step (every member reads the same)."""

    admission: np.ndarray  # [P] int32: HOLD / READY / 0 per process
    failed: int  # devices whose member could not build its inputs
    not_ahead: bool  # some member lets no step start early after this one
    commit: bool  # some member wants this step committed now
    same_step: bool  # every device ran the same step number

    @property
    def quiet(self) -> bool:
        """Nobody asked to be admitted, and nobody held admissions back."""
        return not np.any(self.admission)


def read(agreed: np.ndarray, devices: int) -> Verdict:
    """The :class:`Verdict` of one step from its agreed votes (``agreed [P + EXTRA]``: the rows
    summed over the devices, admission columns folded to HOLD / READY / 0) over ``devices`` devices."""
    agreed = np.asarray(agreed)
    p = agreed.shape[0] - EXTRA
    bits = agreed[p + STEP:]
    return Verdict(admission=agreed[:p], failed=int(agreed[p + FAIL]), not_ahead=bool(agreed[p + NOT_AHEAD]),
                   commit=bool(agreed[p + COMMIT]), same_step=bool(np.all((bits == 0) | (bits == devices))))

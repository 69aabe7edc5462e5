"""Hot spares: processes that are up, connected and compiled, but take no part in the steps.

A run with spares has a *width*: the number of members it trains with (``jaxft launch
--spares K`` starts K workers more than that). A ready joiner is a spare while the members
are at full width; when a member dies, the survivors take a spare in *before* they commit a
step without it, so no step commits below the width while a spare is ready. The global batch
is fixed, so who the members are never changes what a step computes.

The decisions, read from what every member shares (the member set and the step's agreed
votes, :mod:`jaxft.core.votes`), so that every member makes them alike:

* :func:`own_admission`: at full width, a member votes no ready joiner in (it stays a spare);
* :func:`swap_first`: below the width, the members sum their votes before the step;
* :func:`to_admit`: the joiners an agreed vote admits, no more than the width has room for;
* :func:`swap_key`: after a failed step, the survivors take a spare in at once, by the first
  proposal under this name in the key-value store (no step's votes needed; every survivor reads
  the same proposal).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from jaxft.core.votes import READY


def own_admission(admission: np.ndarray, members: Collection[int], width: int | None) -> np.ndarray:
    """A member's admission votes ``[P]`` with every READY of a non-member cleared when the
    ``members`` fill ``width`` (None: no spares, unchanged). Holds stay: they are another
    member condition (:data:`jaxft.core.votes.HOLD`). Cleared, not held: a step with spares
    waiting stays quiet, so it may still start the next step early or leave its commit to a
    later one."""
    if width is None or len(members) < width:
        return admission
    out = np.array(admission, copy=True)
    for p in range(len(out)):
        if p not in members and out[p] == READY:
            out[p] = 0
    return out


def swap_first(members: Collection[int], width: int | None) -> bool:
    """Whether the members sum their votes before running a step (alike everywhere: it depends
    on the member set only): spares are configured and the members are fewer than the width,
    so a ready spare must enter before any step commits without it."""
    return width is not None and len(members) < width


def to_admit(admission: Sequence[int] | np.ndarray, members: Collection[int], width: int | None) -> tuple[int, ...]:
    """The joiners an agreed admission vote ``[P]`` (folded to HOLD / READY / 0) lets in:
    non-members whose slot is READY, the lowest process ids first, no more than
    ``width - len(members)`` (None: all)."""
    ready = [p for p, v in enumerate(admission) if int(v) == READY and p not in members]
    if width is None:
        return tuple(ready)
    return tuple(ready[:max(0, width - len(members))])


def swap_key(entry: Mapping[int, int]) -> str:
    """The name of the decision which spares enter after a step over ``entry`` (process ->
    life) failed: the same for every survivor of that step and never for another step (a
    failed step's entry holds a life that ended, and a life never comes back)."""
    return ",".join(f"{p}.{life}" for p, life in sorted(entry.items()))


def initial(spares: Collection[int], num_processes: int) -> tuple[int, ...]:
    """The processes that form a cold start's member set: all but the ``spares`` (which wait to
    be admitted). Raises ValueError if that leaves nobody or names a process that does not exist."""
    bad = [p for p in spares if not 0 <= p < num_processes]
    if bad:
        raise ValueError(f"spare process ids {bad} are not in 0..{num_processes - 1}")
    members = tuple(p for p in range(num_processes) if p not in spares)
    if not members:
        raise ValueError(f"{len(spares)} spares among {num_processes} processes leave no member")
    return members

"""Rejoin: who is new, who is behind, who donates, and the state transfer.

A restarted (or late) process enters the live set with an old or empty state. Inside the
first step whose member map has a member the others had not committed with
(:func:`is_new`, computed from the agreed map alone, so every member gets the same answer
without a round trip), every member reports its step; the members behind receive the
state of the lowest-numbered member holding the latest step (the donor, :func:`donor`),
bit for bit, through :func:`jaxft.transfer.broadcast_tree`. The data position and the RNG
are functions of the step, so the step and the state are all a joiner needs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping

import numpy as np

from jaxft import transfer
from jaxft.types import PyTree


def is_new(known: Mapping[int, int] | None, current: Mapping[int, int]) -> bool:
    """Whether ``current`` (process -> incarnation) has a member absent from ``known``.

    A fresh process knows nothing (``known is None``) so it always answers True, and every
    other member answers True too because that process's incarnation is new to them.
    """
    return known is None or any(known.get(p) != i for p, i in current.items())


def donor(steps: Mapping[int, int]) -> int:
    """The lowest-numbered process holding the latest step."""
    latest = max(steps.values())
    return min(p for p, s in steps.items() if s == latest)


@dataclasses.dataclass(frozen=True)
class Rehydration:
    """What one joiner received (logged as the ``rehydrated`` event)."""

    step: int  # the step it now holds
    from_step: int  # the step it held before
    donor: int
    bytes: int
    seconds: float


def agree_steps(step: int, generation: int, members) -> tuple[dict[int, int], int]:
    """All-gather every member's ``(step, generation)``: ``({process: step}, max generation)``."""
    rows = transfer.allgather_rows(np.array([step, generation], np.int64), members.mesh)
    procs = [d.process_index for d in members.devices]
    return {p: int(r[0]) for p, r in zip(procs, rows)}, int(rows[:, 1].max())


def rehydrate(step: int, state: PyTree, members, me: int, steps: Mapping[int, int],
              on_start: Callable[[], None] | None = None) -> tuple[int, PyTree, Rehydration | None]:
    """Bring every member to the donor's ``(step, state)``; a collective over ``members``.

    ``steps`` is :func:`agree_steps`'s map. Returns this process's new step and state, and
    a :class:`Rehydration` if this process was behind (None for the donor and bystanders
    already up to date). With every member at the same step nothing moves. ``on_start``
    runs once the transfer is decided, before any byte moves (the ``during-rehydrate``
    fault point).
    """
    latest = max(steps.values())
    if all(s == latest for s in steps.values()):
        return step, state, None
    if on_start is not None:
        on_start()
    source = donor(steps)
    t0 = time.perf_counter()
    payload = {"step": np.int64(step), "state": state}
    got = transfer.broadcast_tree(payload, source, members.mesh)
    info = None
    if steps[me] != latest:
        info = Rehydration(step=latest, from_step=steps[me], donor=source, bytes=transfer.tree_nbytes(payload),
                           seconds=round(time.perf_counter() - t0, 4))
    return int(got["step"]), got["state"], info

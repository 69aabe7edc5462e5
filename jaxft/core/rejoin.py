"""Who is new, who donates, who is refused: the rejoin's decisions.

A member map is ``{process: incarnation}``. A member is new to a step when the map the
members last committed with does not hold its life (:func:`is_new`; a fresh process knows no
map, so every member then answers True). In a step whose members are not all at the same
step (a joiner; members that ran different steps), every member contributes its step and the
signature of its state's structure, and they decide alike who donates and who is refused
(:func:`reference`); the members behind then receive the donor's step and state.
"""

from __future__ import annotations

from collections.abc import Mapping


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


def reference(steps: Mapping[int, int], signatures: Mapping[int, bytes]) -> tuple[int, tuple[int, ...]]:
    """``(donor, refused)``: the reference signature is the most common among the processes at
    the latest step (ties: the lowest process's); the donor is the lowest process at the
    latest step holding it, and every process with another signature is refused."""
    latest = max(steps.values())
    at_latest = sorted(p for p, s in steps.items() if s == latest)
    counts: dict[bytes, int] = {}
    for p in at_latest:
        counts[signatures[p]] = counts.get(signatures[p], 0) + 1
    best = max(counts.values())
    ref = next(signatures[p] for p in at_latest if counts[signatures[p]] == best)
    donor = min(p for p in at_latest if signatures[p] == ref)
    return donor, tuple(sorted(p for p in steps if signatures[p] != ref))

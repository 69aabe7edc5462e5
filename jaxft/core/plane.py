"""When a member set's CPU data plane (gloo) must be rebuilt, and when a fresh communicator does.

XLA's CPU client caches one gloo communicator per device list, whichever lives built it. A
list this process stepped on with other lives (one of them died since) or whose communicator a
failed step left suspect needs a new backend; a list it never stepped on gets a fresh
communicator from the backend it has, once the list's stale rendezvous keys are gone. A member
set that gains a life (an admission, a spare's swap) syncs: every member says whether it needs
a rebuild (:func:`own_need`) before the sync's first barrier, and past it every member reads
every answer and decides alike (:func:`rebuild_agreed`). A fresh member that keeps its backend
takes the members' history (:func:`history`), so that it later decides as they do over a list
they stepped on before it came (one of its process's earlier lives was on it).

Pure: the data plane (:mod:`jaxft.worker.dataplane`) does the I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

Lives = Mapping[int, int]  # process id -> incarnation

NEEDS, KEEPS, FRESH = "rebuild", "keep", "fresh"  # one member's answer


def own_need(used: Mapping[tuple[int, ...], Lives], suspect: Collection[tuple[int, ...]],
             current: Lives, synced: Lives | None) -> str:
    """This process's answer for a step over ``current``: :data:`FRESH` (its backend never
    stepped: ``synced`` is None), :data:`NEEDS` (the list is suspect, or was stepped on with
    other lives: its cached communicator is stale), else :data:`KEEPS`."""
    if synced is None:
        return FRESH
    key = tuple(sorted(current))
    if key in suspect or (key in used and dict(used[key]) != dict(current)):
        return NEEDS
    return KEEPS


def rebuild_agreed(answers: Collection[str]) -> bool:
    """Whether the members rebuild, from every member's answer: when one needs it, and at a cold
    start (every backend fresh: the first step rebuilds, as it always did)."""
    return NEEDS in answers or all(a == FRESH for a in answers)


def answer(used: Mapping[tuple[int, ...], Lives], suspect: Collection[tuple[int, ...]], current: Lives,
           synced: Lives | None) -> dict[str, Any]:
    """This member's answer (JSON-able): its need (:func:`own_need`) and its history."""
    return {"need": own_need(used, suspect, current, synced),
            "used": [[list(k), sorted(v.items())] for k, v in used.items()],
            "suspect": [list(k) for k in suspect]}


def history(answers: Iterable[Mapping[str, Any]]) -> tuple[dict[tuple[int, ...], dict[int, int]],
                                                           set[tuple[int, ...]]]:
    """The lists the members stepped on (with their lives) and those they hold suspect, from
    their answers (:func:`answer`): what a fresh member takes when the backend is kept."""
    used: dict[tuple[int, ...], dict[int, int]] = {}
    suspect: set[tuple[int, ...]] = set()
    for a in answers:
        used.update({tuple(k): {int(p): int(i) for p, i in v} for k, v in a["used"]})
        suspect.update(tuple(k) for k in a["suspect"])
    return used, suspect

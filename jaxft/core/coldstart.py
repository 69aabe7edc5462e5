"""A cold start's process stranded in its first liveness query: what the others' records say.

In a cold start every process asks the service over the cold start's whole set ``S``. The
service keeps an unanswered query's entrants by process id, not by life: a query over ``S``
that an earlier life of process ``p`` entered before it died stays open, ``p`` counted in.
When ``p``'s restart has connected but is still setting up, the others' asks complete that old
query, and the answer names ``p``'s new life, which never asked (the service counts every
connected process in the query as having asked). ``p`` asks later, alone in a new query over
``S``, and would wait there for ever:

* if the answer named all of ``S`` (or a confirmation met another stale entry of ``p``'s
  earlier life, one over the survivors it asked just before it died), the others entered the
  first step with ``p`` and publish the member set with its lives (``jaxft/members/<writer>``):
  ``p``, wherever it waits (that query, or for a member list without its earlier life), takes
  that answer as its own (:class:`Adopt`, :func:`adoptable`) and enters with them;
* if the answer left a process out (its restart had not connected), the others confirm the
  smaller set that names ``p`` (:func:`jaxft.core.liveness.on_answer`) and say so first
  (``jaxft/cold/<writer>``): ``p`` asks that set too (:class:`Switch`);
* if the others started without ``p`` (a members record without it), ``p`` joins them as a
  restart does (:class:`Joined`; it waits to be admitted).

The same can strand a member in a later step's entry query (:func:`entered_with`): it takes
the members' entry too.

Seen in the soak with early connects (docs/design.md, 'A restart connects once the members
dropped its previous life'): two members confirming ``{0, 2, 3}``, process 3 and process 1's
restart in a query over all four, each pair waiting for the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Record:
    """A record another process wrote since this one began its query: the member set it
    entered a step with (``lives``: their incarnations), or the set it confirms (no lives)."""

    writer: int
    pids: tuple[int, ...]
    time: float
    lives: Mapping[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Joined:
    """The others started without this process: it joins them as a restart does."""


@dataclasses.dataclass(frozen=True)
class Adopt:
    """The others entered the first step with this process: ``entry`` is their entry answer."""

    entry: Mapping[int, int]


@dataclasses.dataclass(frozen=True)
class Switch:
    """The others confirm ``pids``, this process among them: it asks that set."""

    pids: tuple[int, ...]


def stranded(process_id: int, incarnation: int | None, asked: Sequence[int], cold: Collection[int],
             members: Sequence[Record], confirming: Sequence[Record]) -> Joined | Adopt | Switch | None:
    """What a process (its life: ``incarnation``, None if unknown) waiting in the liveness
    query over ``asked`` during a cold start of ``cold`` does, from the members records and
    confirmation records written since it asked (None: go on waiting). Only the cold start's
    first query (``asked`` is ``cold``) is ever left for a confirmation naming this process: a
    confirmation it makes itself is the others' too."""
    if members:
        newest = max(members, key=lambda r: r.time)
        entry = adoptable(process_id, incarnation, newest)
        if entry is not None:
            return Adopt(entry)
        if process_id not in newest.pids:
            return Joined()
        return None
    if sorted(asked) != sorted(cold):
        return None
    named = [r for r in confirming if process_id in r.pids and sorted(r.pids) != sorted(asked)]
    if named:
        return Switch(tuple(sorted(max(named, key=lambda r: r.time).pids)))
    return None


def adoptable(process_id: int, incarnation: int | None, newest: Record | None) -> dict[int, int] | None:
    """The entry of the newest members record if it names this process's current life
    (``incarnation``): the members entered a step with it on an answer it never got, and wait
    for it there. None otherwise (a record naming an earlier life of it, or none)."""
    if incarnation is None or newest is None or newest.lives is None:
        return None
    if newest.lives.get(process_id) != incarnation:
        return None
    return dict(newest.lives)


def entered_with(process_id: int, incarnation: int | None, asked: Sequence[int], expected: Mapping[int, int],
                 last_entry: Mapping[int, int] | None, members: Sequence[Record]) -> Adopt | None:
    """A member (or an admitted joiner) waiting in a step's entry query over ``asked``: the
    others' entry if the newest members record (of all, ``members``) is over exactly ``asked``,
    names this life (``incarnation``) and every life this process expects (``expected``: the
    members' and joiners' it knows, -1 for one it does not), and is not the entry this process
    last entered with (``last_entry``: such a record may be that step's); None otherwise.

    Not only cold starts: an earlier life of this process that left a query over ``asked``
    (re-asked on a death record, then died) is still counted in it by the service. The
    others' asks over ``asked`` complete that query, and the answer names this life; an ask of
    this life that reaches the service a moment later opens a new query, where it would wait for
    ever while the others wait for it inside the step (soak seed 2, step 94). A record can name
    this life over ``asked`` with those lives only if the members entered a step so since this
    process last entered one (each member rewrites its record whenever its entry changes, and a
    member that left a set died: its life changed)."""
    if incarnation is None or not members:
        return None
    newest = max(members, key=lambda r: r.time)
    if sorted(newest.pids) != sorted(asked):
        return None
    entry = adoptable(process_id, incarnation, newest)
    if entry is None or (last_entry is not None and dict(last_entry) == entry):
        return None
    if any(life >= 0 and entry.get(p) != life for p, life in expected.items()):
        return None
    return Adopt(entry)

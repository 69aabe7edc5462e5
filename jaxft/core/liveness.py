"""A liveness query's answer: final, or asked again over fewer processes.

The coordination service answers ``get_live_nodes(pids)`` once every process of ``pids`` it
believes alive has asked, with those processes and their incarnations; a process that stops
waiting stays counted in (there is no cancel). Every member must therefore make the same
sequence of queries, or one member's next query meets another's previous one. Two rules keep
them in step (the I/O side: :class:`jaxft.worker.deaths.DeathWatch`):

* a member told that a process it waits for died (its launcher's death record) asks again
  without it (:func:`on_deaths`);
* an answer that leaves out a process asked, or names another life of one than the member
  entered the step with (the launcher retires a dead life, see :mod:`jaxft.supervisor.retire`),
  is confirmed by one more query over the survivors (:func:`on_answer`): whoever got such an
  answer, and whoever asked again on a death record, meet in that same next query.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping


@dataclasses.dataclass(frozen=True)
class Ask:
    """Ask the service: ``get_live_nodes(pids)``."""

    pids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Done:
    """The query's final answer: ``{process: incarnation}``, every process asked, as expected."""

    answer: Mapping[int, int]


def on_answer(asked: Collection[int], answer: Mapping[int, int],
              lives: Mapping[int, int] | None = None) -> Ask | Done:
    """The next move after the service answered the query over ``asked``: done if the answer
    names every process asked, each with the life ``lives`` expects (where it names one);
    otherwise ask again over the survivors (the processes answered with the expected life)."""
    same = sorted(p for p in answer if lives is None or p not in lives or answer[p] == lives[p])
    if sorted(answer) == sorted(asked) and len(same) == len(answer):
        return Done(dict(answer))
    return Ask(tuple(same))


def on_deaths(asked: Collection[int], dead: Collection[int]) -> Ask | None:
    """While waiting in the query over ``asked``: ask again without those of ``dead`` in it, or
    None to go on waiting."""
    gone = set(dead) & set(asked)
    if not gone:
        return None
    return Ask(tuple(sorted(p for p in asked if p not in gone)))


def reuse_left_query(answered: bool, answer: Mapping[int, int] | None, expect: Collection[int],
                     seen: Mapping[int, Collection[int]], answered_before_admission: bool) -> bool:
    """Whether a member about to ask over a set must instead wait on the query over that same
    set it left earlier (the service still counts it in there).

    While that query is open, yes: the first ask of the joiners being admitted (``expect``)
    would complete it, and leave a new query of the members waiting for them for ever. Once
    answered, only if the answer came after the joiners were admitted and names a life of each
    of them that this member has not seen before (``seen``: every life it saw per process):
    an answer naming a life seen before, or one that came before the admission, is an old
    query's, and taking it would leave this member one query out of step with the others.
    """
    if not answered:
        return True
    if answered_before_admission or answer is None or not expect:
        return False
    return all(p in answer and answer[p] not in seen.get(p, ()) for p in expect)

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


def reuse_left_query(answered: bool, answer: Mapping[int, int] | None, admitted: Mapping[int, int],
                     adopted: bool = False) -> bool:
    """Whether a member about to ask over a set must instead wait on the query over that same
    set it left earlier (the service still counts it in there). ``admitted``: the joiners
    being admitted into the set, each with the life (service incarnation) it registered
    before it said it was ready.

    While that query is open, yes: the first ask of the joiners would complete it, and leave a
    new query of the members waiting for them for ever. Once answered, only if the answer
    names each joiner with its admitted life: only that life's ask, made once a member had
    admitted it, completes the query so. Another answer is an old one's (an earlier life of
    the joiner, or the life the launcher's retirement registered), and taking it would leave
    this member one query out of step with the others. The answer may well have come before
    this member admitted the joiner itself: another member admitted it first, and the
    joiner's first ask completed the query this member had left (it then asked anew and
    waited for the others for ever: seen on issue 40's schedule, 2 of 5 runs).

    A query left when this process entered a step on the others' answer to another query
    (``adopted``, :mod:`jaxft.core.coldstart`) is always taken, answered or not: its ask is
    still counted in the service, so the others' next ask over that set (the step's exit
    query) completes it, and that answer is this process's exit answer too. Asked anew, it
    waited alone while they ran the next step without it (a member's all-reduce timed out).
    """
    if not answered or adopted:
        return True
    if answer is None or not admitted:
        return False
    return all(answer.get(p) == life for p, life in admitted.items())

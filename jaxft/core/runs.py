"""Where a process's ``run()`` stands, from the run marks (:mod:`jaxft.worker.runs`).

A program may call ``run()`` more than once (``run(20); run(80)``): every process calls them
in the same order, so the k-th call is run ``k`` everywhere. The members mark each run in the
coordination service's key-value store, ``jaxft/run/<k>``: ``running`` when it begins (first
writer wins, so a late mark never overwrites a later state) and ``finished:<step>`` when it
ends. A process compares the newest mark with the run it is in (:func:`state`):

* ``running``: the members are in this run (or an earlier one): train with them;
* ``passed``: the members are in a later run: this process's run is over for them, and it
  catches up (it is admitted and rehydrated at their step, and its earlier runs return);
* ``finished``: this run, or a later one, ended, and nothing runs after it: a restart exits 0
  rather than train the run again on its own.
"""

from __future__ import annotations

RUNNING, PASSED, FINISHED = "running", "passed", "finished"


def _finished_at(mark: str, target: int | None) -> bool:
    """Whether ``mark`` says finished, at or past ``target`` (any step if either is unknown)."""
    if not mark.startswith(FINISHED):
        return False
    step = mark.partition(":")[2]
    return target is None or not step.isdigit() or int(step) >= target


def state(index: int, target: int | None, all_marks: dict[int, str]) -> str:
    """Where run ``index`` (to ``target``) stands, given the marks (see the module docstring).

    ``index`` 0 (no ``run()`` called: a bare ``group.step()`` loop) reads the newest run's mark.
    """
    if not all_marks:
        return RUNNING
    latest = max(all_marks)
    if index == 0:
        return FINISHED if _finished_at(all_marks[latest], None) else RUNNING
    if latest < index:
        return RUNNING
    if latest == index:
        return FINISHED if _finished_at(all_marks[latest], target) else RUNNING
    return FINISHED if _finished_at(all_marks[latest], None) else PASSED

"""The run marks in the coordination service: which ``run()`` of the job the members are in.

The members mark each run in the key-value store, ``jaxft/run/<k>``: ``running`` when it
begins (first writer wins, so a late mark never overwrites a later state) and
``finished:<step>`` when it ends; :func:`jaxft.core.runs.state` says what the marks mean for a
process in a given run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxft import _compat
from jaxft.core import runs as runs_core
from jaxft.core.runs import FINISHED, RUNNING
from jaxft.worker import kv

PREFIX = "jaxft/run/"


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """This process's ``run()`` as :meth:`ElasticGroup.begin_run` found it."""

    index: int  # 1 for the first run() of the program, 2 for the next, ...
    finished: bool  # the members finished it (and nothing runs after it): exit 0
    passed: bool  # the members are in a later run: catch up with them


def begin(index: int) -> None:
    """Mark run ``index`` as begun (no effect if any mark of it exists already)."""
    _compat.create_key(kv.client(), f"{PREFIX}{index}", RUNNING)


def end(index: int, step: int | None) -> None:
    """Mark run ``index`` as finished at ``step`` (None: whatever step a reader waits for)."""
    kv.client().key_value_set(f"{PREFIX}{index}", f"{FINISHED}:{'' if step is None else int(step)}",
                              allow_overwrite=True)


def marks(client: Any | None = None) -> dict[int, str]:
    """``{run index: mark}`` of every run marked so far (empty if none, or unreachable)."""
    out: dict[int, str] = {}
    for key, value in kv.try_dir_get(PREFIX, client):
        name = key.rstrip("/").rsplit("/", 1)[-1]
        if name.isdigit():
            out[int(name)] = value
    return out


class Runs:
    """This process's ``run()`` calls, read against the members' marks."""

    def __init__(self) -> None:
        self.index = 0  # how many run()s this process began
        self.target: int | None = None  # the step the current run trains to

    def begin_run(self, target: int) -> RunInfo:
        """Begin this process's next ``run()``, to step ``target``."""
        self.index += 1
        self.target = target
        state = runs_core.state(self.index, target, marks())
        if state == RUNNING:
            begin(self.index)
        return RunInfo(self.index, finished=state == FINISHED, passed=state == runs_core.PASSED)

    def finish(self, step: int | None) -> None:
        """The current run ended at ``step`` (a run the members passed keeps their mark)."""
        if runs_core.state(self.index, self.target, marks()) != runs_core.PASSED:
            end(self.index, step)

    def finished(self) -> bool:
        """Whether peers finished the current run, and nothing runs after it (a later ``run()``
        in progress is not an end: this process catches up)."""
        return runs_core.state(self.index, self.target, marks()) == FINISHED

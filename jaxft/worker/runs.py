"""The run marks in the coordination service: which ``run()`` of the job the members are in.

The members mark each run in the key-value store, ``jaxft/run/<k>``: ``running`` when it
begins (first writer wins, so a late mark never overwrites a later state) and
``finished:<step>`` when it ends; :func:`jaxft.core.runs.state` says what the marks mean for a
process in a given run.
"""

from __future__ import annotations

from typing import Any

from jaxft import _compat
from jaxft.core.runs import FINISHED, RUNNING
from jaxft.worker import kv

PREFIX = "jaxft/run/"


def begin(index: int) -> None:
    """Mark run ``index`` as begun (no effect if any mark of it exists already)."""
    _compat.create_key(kv.client(), f"{PREFIX}{index}", RUNNING)


def end(index: int, step: int | None) -> None:
    """Mark run ``index`` as finished at ``step`` (None: whatever step a reader waits for)."""
    kv.client().key_value_set(f"{PREFIX}{index}", f"{FINISHED}:{'' if step is None else int(step)}",
                              allow_overwrite=True)


def marks(client: Any | None = None) -> dict[int, str]:
    """``{run index: mark}`` of every run marked so far (empty if none, or unreachable)."""
    try:
        entries = (client or kv.client()).key_value_dir_get(PREFIX)
    except Exception:  # noqa: BLE001 - NOT_FOUND on some versions, or the service is gone
        return {}
    out: dict[int, str] = {}
    for key, value in entries or ():
        name = key.rstrip("/").rsplit("/", 1)[-1]
        if name.isdigit():
            out[int(name)] = value
    return out

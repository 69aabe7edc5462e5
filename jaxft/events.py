"""The run's JSON-lines event log (``RUN_DIR/events.jsonl``).

Every worker and the launcher append to the same file. Each event is written with a
single ``write`` on an ``O_APPEND`` descriptor under an exclusive ``flock``, so lines
from several processes never interleave.

Every event also goes to the ``jaxft.events`` logger (with or without a run directory):
failures and abandoned work at WARNING, recoveries at INFO, routine progress at DEBUG.
What reaches the console is the application's (or the launcher's) choice.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

EVENTS_FILE = "events.jsonl"

logger = logging.getLogger(__name__)
WARNING_EVENTS = frozenset({"step_failed", "checkpoint_abandoned", "checkpoint_rejected",
                            "checkpoint_data_mismatch", "hung", "crash_loop"})
INFO_EVENTS = frozenset({"exit", "fault", "join", "rehydrated", "restored", "restore_deferred", "checkpoint_saved",
                         "final", "launch", "restart", "run_start", "run_end", "interrupted", "data_plane"})


class EventLog:
    """Appends events to ``run_dir/events.jsonl``; a no-op when ``run_dir`` is None."""

    def __init__(self, run_dir: str | os.PathLike | None, process: int | str, incarnation: int = 0):
        self.path = None if run_dir is None else os.path.join(os.fspath(run_dir), EVENTS_FILE)
        self.process = process
        self.incarnation = incarnation
        if self.path is not None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def log(self, event: str, **fields: Any) -> dict:
        """Write one event; returns the record (also when logging is off)."""
        record = {"time": time.time(), "event": event, "process": self.process,
                  "incarnation": self.incarnation}
        record.update(fields)  # the launcher logs on behalf of a worker: process=...
        level = (logging.WARNING if event in WARNING_EVENTS else logging.INFO if event in INFO_EVENTS
                 else logging.DEBUG)
        if logger.isEnabledFor(level):
            details = " ".join(f"{k}={v}" for k, v in fields.items())
            logger.log(level, "process %s (incarnation %s): %s %s", record["process"], self.incarnation,
                       event, details)
        if self.path is not None:
            line = (json.dumps(record, default=_to_json) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.write(fd, line)
            finally:
                os.close(fd)  # closing releases the lock
        return record


def _to_json(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy / jax scalars and arrays
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    return str(value)


def read_events(run_dir: str | os.PathLike) -> list[dict]:
    """All events of a run, in file order. A torn last line (writer killed) is skipped."""
    return list(iter_events(run_dir))


REQUIRED_FIELDS = ("time", "event", "process")


def iter_events(run_dir: str | os.PathLike) -> Iterator[dict]:
    """The events of a run; lines that are not events (torn, not JSON, or JSON without
    ``time``, ``event`` and ``process``) are skipped."""
    path = os.path.join(os.fspath(run_dir), EVENTS_FILE)
    if not os.path.exists(path):
        return
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if (isinstance(record, dict) and all(k in record for k in REQUIRED_FIELDS)
                    and isinstance(record["time"], (int, float)) and isinstance(record["event"], str)):
                yield record

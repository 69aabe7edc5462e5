"""The I/O of :mod:`jaxft.core.coldstart`: the records a cold start's processes write, and the
watch a process waiting in its first liveness query keeps on them.

* ``jaxft/members/<writer>`` (:func:`jaxft.worker.admission.publish_members`): the member set
  each member entered a step with, and their lives;
* ``jaxft/cold/<writer>`` (:func:`publish_confirm`): the set a cold start's process confirms
  after an answer that left a process out, written before it asks.

:class:`ColdStartWatch` is the ``give_up`` of that first query (checked while it waits): it
reads both directories every :data:`POLL_S` and keeps what the records say in :attr:`move`.
:class:`EntryWatch` is that of a later step's entry query: it reads the members records only.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from jaxft.core import coldstart
from jaxft.worker import kv
from jaxft.worker.admission import MEMBERS_KEY

CONFIRM_PREFIX = "jaxft/cold/"
POLL_S = 0.25
logger = logging.getLogger(__name__)


def publish_confirm(pids: Sequence[int], writer: int) -> None:
    """Say that ``writer``, in a cold start, now confirms the set ``pids`` (before it asks)."""
    value = json.dumps({"pids": sorted(int(p) for p in pids), "time": time.time()})
    kv.client().key_value_set(f"{CONFIRM_PREFIX}{writer}", value, allow_overwrite=True)


def _records(prefix: str) -> dict[str, str]:
    return dict(kv.try_dir_get(prefix))


def _parse(key: str, value: str) -> coldstart.Record:
    r = json.loads(value)
    lives = r.get("lives")
    return coldstart.Record(writer=int(key.rsplit("/", 1)[-1]), pids=tuple(r["pids"]), time=float(r["time"]),
                            lives=None if lives is None else {int(p): int(i) for p, i in lives.items()})


def _members(entries: Iterable[tuple[str, str]] | None = None) -> list[coldstart.Record]:
    """Every member's newest members record (from ``entries``, the directory's ``(key, value)``
    pairs, if the caller read them already)."""
    pairs = _records(f"{MEMBERS_KEY}/").items() if entries is None else entries
    return [_parse(k, v) for k, v in pairs]


class _Throttle:
    """True at most once every :data:`POLL_S`, the first time :data:`POLL_S` after it was made."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def due(self) -> bool:
        if time.monotonic() - self._last < POLL_S:
            return False
        self._last = time.monotonic()
        return True


class ColdStartWatch:
    """A cold start's first liveness query's ``give_up()``: True once the others' records say
    this process is stranded there (:func:`jaxft.core.coldstart.stranded`; the decision in
    :attr:`move`). ``asking()``: the set this process waits in now. A record counts if it was
    written or changed since the query began, or written after ``since`` (this life's start:
    a restart that took itself for part of a cold start after the others started without it);
    a members record only if also after ``members_since`` (when this process last found the
    newest one's members gone: such a record says nothing of who runs now)."""

    def __init__(self, process_id: int, incarnation: int | None, cold: Collection[int],
                 asking: Callable[[], Sequence[int]], since: float | None = None,
                 members_since: float | None = None):
        self.process_id, self.cold, self.asking, self.since = process_id, sorted(cold), asking, since
        self.members_since = members_since
        self.incarnation = incarnation  # this life's, as it registered (None: unknown)
        self.move: coldstart.Joined | coldstart.Adopt | coldstart.Switch | None = None
        self._members_prefix = f"{MEMBERS_KEY}/"
        # only records written or changed since this query began count
        self._before = {**_records(self._members_prefix), **_records(CONFIRM_PREFIX)}
        self._throttle = _Throttle()

    def __call__(self) -> bool:
        if not self._throttle.due():
            return False
        members = [r for r in self._new(self._members_prefix)
                   if self.members_since is None or r.time > self.members_since]
        confirming = self._new(CONFIRM_PREFIX)
        confirming = [r for r in confirming if r.writer != self.process_id]
        self.move = coldstart.stranded(self.process_id, self.incarnation, self.asking(), self.cold, members,
                                       confirming)
        return self.move is not None

    def _new(self, prefix: str) -> list[coldstart.Record]:
        records = [(k, v, _parse(k, v)) for k, v in _records(prefix).items()]
        return [r for k, v, r in records
                if self._before.get(k) != v or (self.since is not None and r.time > self.since)]


class EntryWatch:
    """A later step's entry query's ``give_up()``: True once the members records say the
    others entered the step with this life over the set it asks
    (:func:`jaxft.core.coldstart.entered_with`, with ``expected`` and ``last_entry``; the entry
    in :attr:`move`). Reads nothing until the query has waited :data:`POLL_S`, then the
    members records every :data:`POLL_S`."""

    def __init__(self, process_id: int, incarnation: int | None, asking: Callable[[], Sequence[int]],
                 expected: Mapping[int, int], last_entry: Mapping[int, int] | None):
        self.process_id, self.incarnation, self.asking = process_id, incarnation, asking
        self.expected, self.last_entry = dict(expected), last_entry
        self.move: coldstart.Adopt | None = None
        self._throttle = _Throttle()

    def __call__(self) -> bool:
        if self.incarnation is None or not self._throttle.due():
            return False
        self.move = coldstart.entered_with(self.process_id, self.incarnation, self.asking(), self.expected,
                                           self.last_entry, _members())
        return self.move is not None


def adopted_entry(process_id: int, incarnation: int | None,
                  entries: Iterable[tuple[str, str]] | None = None) -> dict[int, int] | None:
    """The members' entry if their newest members record names this life (``incarnation``,
    :func:`jaxft.core.coldstart.adoptable`): they wait for it in a step it never entered.
    ``entries``: the members directory as already read (None: read it)."""
    records = _members(entries)
    newest = max(records, key=lambda r: r.time) if records else None
    return coldstart.adoptable(process_id, incarnation, newest)


def told(process_id: int, watch: ColdStartWatch | EntryWatch | None
         ) -> coldstart.Adopt | coldstart.Switch | coldstart.Joined:
    """What a process whose entry query ``watch`` gave up on does (logged): enter with the
    others (:class:`~jaxft.core.coldstart.Adopt`), ask the set they confirm
    (:class:`~jaxft.core.coldstart.Switch`), or join them as a restart does."""
    move = watch.move if watch is not None else None
    if isinstance(move, coldstart.Adopt):
        if isinstance(watch, EntryWatch):
            logger.warning("process %d: the others entered the step over %s with it on an answer it never got "
                           "(a query an earlier life of it left); entering with them", process_id, sorted(move.entry))
        else:
            logger.warning("process %d: the others entered the first step with it on an answer it never got (a "
                           "query an earlier life of it entered); entering with them", process_id)
        return move
    if isinstance(move, coldstart.Switch):
        logger.warning("process %d: the others confirm %s on an answer it never got; asking that", process_id,
                       list(move.pids))
        return move
    logger.info("process %d: the others started without it; joining them", process_id)
    return coldstart.Joined()

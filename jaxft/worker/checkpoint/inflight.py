"""An async save in flight: which save it is, and the watcher that reports its outcome.

:meth:`CheckpointStore.save <jaxft.worker.checkpoint.store.CheckpointStore.save>` returns
once the host snapshot is taken and Orbax's blocking phase passed; the rest (writes,
checksum, publication) runs in Orbax's threads. A :class:`_Save` follows that rest from a
thread of its own, so that ``checkpoint_saved`` is logged the moment the primary publishes
and ``checkpoint_abandoned`` (with the root cause) when the save ends without publishing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from jaxft.protocol import Event
from jaxft.worker.checkpoint import managers, orbax

if TYPE_CHECKING:
    from jaxft.worker.checkpoint.store import CheckpointStore

logger = logging.getLogger(__name__)

BARRIER_NAMESPACE = "jaxft/ckpt"  # key-value prefix of the background-phase barriers


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _root_cause(e: BaseException | None) -> str:
    """The first line of the exception that started it all (Orbax re-raises in `finally`)."""
    seen: list[BaseException] = []
    while e is not None and e not in seen and len(seen) < 20:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return first_line(seen[-1])


@dataclasses.dataclass(frozen=True)
class SaveKey:
    """Which save: ``step`` by ``members`` (sorted) in their lives ``incarnations``
    (process -> incarnation), and the names unique to that (members, incarnations, step)."""

    step: int
    members: tuple[int, ...]
    incarnations: Mapping[int, int]
    digest: str  # of (members, incarnations): one per manager lineage

    @classmethod
    def of(cls, step: int, members: tuple[int, ...], incarnations: Mapping[int, int] | None) -> SaveKey:
        incarnations = dict(incarnations or {})
        text = ",".join(f"{p}:{incarnations.get(p, '?')}" for p in sorted(members))
        return cls(step, members, incarnations, hashlib.sha256(text.encode()).hexdigest()[:12])

    @property
    def prefix(self) -> str:
        """The save's Orbax barrier-key prefix."""
        return f"jaxft_ckpt_{self.digest}_{self.step}"

    @property
    def namespace(self) -> str:
        """The key-value namespace of the save's background-phase barriers."""
        return f"{BARRIER_NAMESPACE}/{self.prefix}"


class _Save:
    """One async save: its manager, its cancel flag, and a watcher that logs the outcome."""

    def __init__(self, store: CheckpointStore, key: SaveKey, mgr, barrier: orbax.SaveBarrier | None,
                 cancel: threading.Event, t0: float, blocking_ms: float):
        self.store = store
        self.key = key
        self.prefix = key.prefix
        self.barrier = barrier
        self.step = key.step
        self.members = key.members
        self.incarnations = dict(key.incarnations)
        self.digest = key.digest
        self.mgr = mgr
        self.cancel = cancel
        self.t0 = t0
        self.blocking_ms = blocking_ms
        self.path = store.step_path(key.step)
        self.done = threading.Event()
        self.ok: bool | None = None
        self.reason: str | None = None
        self._error: BaseException | None = None
        # Not daemon threads: they may call into the distributed client (gRPC), and a daemon
        # thread caught in such a call at interpreter teardown aborts the process. They end
        # when Orbax's own (non-daemon) save threads end, which are bounded.
        self._thread = threading.Thread(target=self._watch, name=f"jaxft-ckpt-{key.step}")

    def start(self) -> None:
        self._thread.start()

    def _wait_manager(self) -> None:
        try:
            self.mgr.wait_until_finished()
        except BaseException as e:  # noqa: BLE001 - reported, never fatal to training
            self._error = e

    def _watch(self) -> None:
        """Log ``checkpoint_saved`` as soon as the step directory is published (the primary's
        rename), or ``checkpoint_abandoned`` when the save ended without publishing."""
        waiter = threading.Thread(target=self._wait_manager, name=f"jaxft-ckpt-wait-{self.step}")
        waiter.start()
        primary = self.members[0] == self.store.process_id
        delay = 0.005
        while True:
            ended = not waiter.is_alive()
            if self.ok is None and managers.is_finalized(self.path):
                self.ok = True
                self.store.events.log(Event.CHECKPOINT_SAVED, step=self.step, path=self.path,
                                      blocking_ms=self.blocking_ms,
                                      write_ms=round((time.perf_counter() - self.t0) * 1000, 2),
                                      processes=list(self.members), primary=primary)
                if primary:
                    managers.remove_stale_tmp(self.store.directory, self.step)
            if ended:
                break
            waiter.join(delay)
            delay = min(delay * 1.5, 0.1)
        if self.ok is None:
            self.ok = False
            self.reason = _root_cause(self._error) if self._error is not None else "not published"
            if self.barrier is not None:  # e.g. a write error here: peers must not wait for us
                self.barrier.abandon(self.reason)
            logger.info("checkpoint %s abandoned: %s", self.path, self.reason)
            self.store.events.log(Event.CHECKPOINT_ABANDONED, step=self.step, path=self.path, reason=self.reason,
                                  blocking_ms=self.blocking_ms, processes=list(self.members))
        orbax.close_quietly(self.mgr)
        self.done.set()

    def lost_member(self, members: Sequence[int], incarnations: Mapping[int, int] | None) -> bool:
        """Whether a member of this save is dead (absent, or restarted) in the new member map."""
        current = set(members)
        for p in self.members:
            if p not in current:
                return True
            if incarnations and p in self.incarnations and incarnations.get(p) != self.incarnations[p]:
                return True
        return False

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

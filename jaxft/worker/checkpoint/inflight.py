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
from jaxft.worker import kv
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

    @property
    def outcome_key(self) -> str:
        """Where the save's primary writes its outcome (:data:`PUBLISHED` or why not)."""
        return f"{self.namespace}/outcome"


PUBLISHED = "published"


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
        self._primary_word: str | None = None  # the primary's outcome when it did not publish
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
                self._published(primary)
            if ended:
                break
            waiter.join(delay)
            delay = min(delay * 1.5, 0.1)
        cause = _root_cause(self._error) if self._error is not None else "not published"
        if self.ok is None and not primary and self.barrier is not None and self.barrier.written:
            self.barrier.abandon(cause)  # (peers must not wait for us meanwhile)
            self._await_primary()
        if self.ok is None:
            self.ok = False
            self.reason = cause
            if self._primary_word is not None:
                self.reason += f"; the primary: {self._primary_word}"
            # A newer checkpoint published meanwhile removed this one's files (managers.remove_stale_tmp):
            # the error above is about them, the reason is this.
            newer = managers.newest_published_after(self.store.directory, self.step)
            if newer is not None:
                self.reason = f"superseded by checkpoint {newer}, published meanwhile; {self.reason}"
            if self.barrier is not None:  # e.g. a write error here: peers must not wait for us
                self.barrier.abandon(self.reason)
            logger.info("checkpoint %s abandoned: %s", self.path, self.reason)
            self.store.events.log(Event.CHECKPOINT_ABANDONED, step=self.step, path=self.path, reason=self.reason,
                                  blocking_ms=self.blocking_ms, processes=list(self.members))
        if primary and len(self.members) > 1:
            self._tell_outcome()
        orbax.close_quietly(self.mgr)
        self.done.set()

    def _published(self, primary: bool) -> None:
        self.ok = True
        self.store.events.log(Event.CHECKPOINT_SAVED, step=self.step, path=self.path, blocking_ms=self.blocking_ms,
                              write_ms=round((time.perf_counter() - self.t0) * 1000, 2),
                              processes=list(self.members), primary=primary)
        if primary:
            managers.remove_stale_tmp(self.store.directory, self.step)

    def _tell_outcome(self) -> None:
        """The primary's outcome, for the members whose own part ended first (:meth:`_await_primary`)."""
        try:
            kv.client().key_value_set(self.key.outcome_key, PUBLISHED if self.ok else f"not published: {self.reason}",
                                      allow_overwrite=True)
        except Exception:  # noqa: BLE001 - best effort: they also watch the directory and the primary's life
            pass

    def _await_primary(self) -> None:
        """This member's part ended (it gave up on a member that died, say) before it saw the
        publish, once every member's writes were done: the primary may publish all the same (it
        needs nobody else for that). Waits for the publish, the primary's word
        that it will not, or the primary's death (at most until ``Timeouts.save`` after the save
        began, the bound of the primary's own background phase, and 1 s), so that this member
        reports what the primary did (it reported ``checkpoint_abandoned`` for a checkpoint the
        primary published 30 ms later, in a CI run)."""
        primary = self.members[0]
        deadline = max(self.t0 + self.store.timeouts.save, time.perf_counter() + 1.0)
        delay = 0.01
        while time.perf_counter() < deadline:
            if managers.is_finalized(self.path):
                self._published(False)
                return
            word = kv.try_get(self.key.outcome_key)
            if word is not None:
                if word == PUBLISHED:
                    self._published(False)
                else:
                    self._primary_word = word
                return
            try:
                if self.barrier is None or self.barrier.gone(primary) is not None:
                    return
            except Exception:  # noqa: BLE001 - the service is gone: nobody can tell
                return
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)

    def lost_members(self, members: Sequence[int], incarnations: Mapping[int, int] | None) -> set[int]:
        """The members of this save that are dead (absent, or restarted) in the new member map."""
        current = set(members)
        return {p for p in self.members
                if p not in current or (incarnations and p in self.incarnations
                                        and incarnations.get(p) != self.incarnations[p])}

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

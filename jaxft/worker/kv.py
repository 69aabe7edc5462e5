"""Helpers on the coordination service: bounded barriers and the
liveness signals that membership and checkpointing share.

Everything here goes through the ``jax.distributed`` client (reached via
:mod:`jaxft._compat`); every wait is bounded by a :class:`~jaxft.timeouts.Timeouts`
setting that its error names.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxft import _compat, protocol
from jaxft import timeouts as _timeouts
from jaxft.errors import BarrierAbandoned, BarrierTimeout
from jaxft.timeouts import Timeouts
from jaxft.worker import lives as lives_lib

logger = logging.getLogger(__name__)


# A barrier instance's outcome, one key beside its arrivals: created once, first writer wins.
DECISION = "decision"
PASS = "pass"
ABANDONED = "abandoned: "


def client() -> Any:
    """The live ``jax.distributed`` client (:class:`~jaxft.InitializeError` before initialize)."""
    return _compat.distributed_client()


def try_get(key: str, c: Any | None = None) -> str | None:
    """The value of ``key``, or None when it is absent (NOT_FOUND is raised, not returned) or
    the service cannot be reached."""
    try:
        return (c if c is not None else client()).key_value_try_get(key)
    except Exception:  # noqa: BLE001
        return None


def try_dir_get(prefix: str, c: Any | None = None) -> list[tuple[str, str]]:
    """The ``(key, value)`` pairs under ``prefix``, or none when there are none (NOT_FOUND on
    some versions) or the service cannot be reached."""
    try:
        return list((c if c is not None else client()).key_value_dir_get(prefix) or ())
    except Exception:  # noqa: BLE001
        return []


def propose(key: str, value: str, c: Any | None = None) -> str | None:
    """Write ``value`` at ``key`` unless a value is there already, and return the value that
    stands (the first proposal wins: every process that proposes reads the same one); None if
    the service cannot be reached."""
    c = c if c is not None else client()
    try:
        c.key_value_set(key, value)  # (no overwrite: ALREADY_EXISTS when another proposed first)
    except Exception:  # noqa: BLE001
        pass
    return try_get(key, c)


# -- liveness: a heartbeat in the key-value store ----------------------------------------------
HEARTBEAT_PREFIX = "jaxft/alive/"


class Heartbeat:
    """This process's liveness signal: a counter in the key-value store under a per-process
    nonce (:meth:`key`), bumped every ``period_s`` by a daemon thread.

    A peer that learnt the nonce (e.g. from an arrival key of :class:`KVBarrier`) declares
    this process dead when the counter stops changing. One per process: :meth:`get`.
    """

    _instance: Heartbeat | None = None
    _lock = threading.Lock()

    def __init__(self, period_s: float = 0.5):
        import jax

        self.nonce = f"{jax.process_index()}-{os.getpid()}-{os.urandom(4).hex()}"
        self.period_s = period_s
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @classmethod
    def get(cls) -> Heartbeat:
        """The process-wide heartbeat, started on first use."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            cls._instance._start()
            return cls._instance

    @staticmethod
    def key(nonce: str) -> str:
        return f"{HEARTBEAT_PREFIX}{nonce}"

    def _start(self) -> None:
        if self._thread is not None:
            return
        c = client()
        c.key_value_set(self.key(self.nonce), "0", allow_overwrite=True)

        def beat() -> None:
            n = 0
            while not self._stop.wait(self.period_s):
                n += 1
                try:
                    c.key_value_set(self.key(self.nonce), str(n), allow_overwrite=True)
                except Exception as e:  # noqa: BLE001 - a transient error must not end the heartbeat:
                    # peers would declare this process dead and abandon every save it is late to.
                    logger.debug("heartbeat %s: %s (retrying)", self.nonce, e)

        self._thread = threading.Thread(target=beat, name="jaxft-heartbeat", daemon=True)
        self._thread.start()
        # Stop before interpreter teardown (and before jax's own atexit shutdown of the
        # client): a daemon thread caught inside a gRPC call at teardown aborts the process.
        atexit.register(self.stop)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)


# -- a barrier that gives up on dead members ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BarrierOptions:
    """What a :class:`KVBarrier` is for and the bounds it gives up by.

    The three bounds are names of :class:`~jaxft.timeouts.Timeouts` settings (read from the
    barrier's ``timeouts``), so every message that one ends names the setting to raise.
    """

    what: str = "barrier"  # what its messages call the operation ("save", "reset")
    dead_after: str = "save_dead_after"  # a missing member whose heartbeat stalls this long is dead
    unknown_after: str = "save_barrier"  # ... and one that reached no barrier of the namespace this long
    timeout_name: str = "save"  # the setting the caller's ``timeout_ms`` comes from
    poll_s: float = 0.005  # first poll interval, growing 1.5x per poll ...
    max_poll_s: float = 0.05  # ... up to this


class KVBarrier:
    """A barrier on the coordination service's key-value store that gives up on dead members.

    Call it as ``barrier(key=..., timeout_ms=...)`` (the signature of Orbax's
    ``BarrierSyncFn``). Each process writes ``<namespace>/<key>/<n>/<process>`` = its
    :class:`Heartbeat` nonce and polls that directory until every expected process has
    written. Unlike ``wait_at_barrier`` (which waits its full timeout for a dead process)
    it gives up, raising :attr:`abandoned_error`, as soon as

    * ``cancel`` is set (a member is known to have died), or
    * a member gave up (:meth:`abandon`), or
    * a missing member's heartbeat stopped for ``timeouts.<options.dead_after>`` (its nonce
      is learnt from an earlier barrier of the same namespace), or
    * a missing member reached no barrier of the namespace within
      ``timeouts.<options.unknown_after>``;
    * (with ``lives``, the member map the barrier is for) a missing member's life is over
      (:mod:`jaxft.worker.lives`: it restarted, or the launcher recorded its exit), and its
      heartbeat is watched from the start (the nonce its life registered);

    and raises :class:`~jaxft.errors.BarrierTimeout` after ``timeout_ms`` (which the
    caller takes from ``timeouts.<options.timeout_name>``). Every message that such a bound
    ends names it. ``options`` (:class:`BarrierOptions`) name the barrier and its bounds.

    Every member of one barrier instance (``<namespace>/<key>/<n>``) gets the same outcome:
    its decision key ``<namespace>/<key>/<n>/decision`` is created once, first writer wins,
    with ``pass`` by a member that saw every arrival, or ``abandoned: <why>`` by one that gives
    up (for any of the reasons above); each member follows what it reads there. So a member
    that arrived and then gave up while the last one arrived passes with the others, or they
    are all abandoned with it (a member that gave up on its own reason but finds another's
    ``abandoned`` raises :attr:`abandoned_error` with that reason).

    Arrival keys outlive their writer, so a member that arrived and then died does not
    block the others. Subclasses adapt it to a caller through two hooks,
    :meth:`_arriving` and :meth:`_passed`.
    """

    abandoned_error: type[BarrierAbandoned] = BarrierAbandoned  # what "gave up on a dead member" raises

    def __init__(self, namespace: str, processes: Sequence[int], me: int, cancel: threading.Event | None = None, *,
                 timeouts: Timeouts | None = None, options: BarrierOptions = BarrierOptions(),
                 lives: Mapping[int, int] | None = None):
        self.namespace = namespace
        self.processes = frozenset(processes)
        self.me = me
        self.cancel = cancel if cancel is not None else threading.Event()
        self.timeouts = timeouts if timeouts is not None else _timeouts.current()
        self.options = options
        self.dead_after_s = float(getattr(self.timeouts, options.dead_after))
        self.unknown_after_s = float(getattr(self.timeouts, options.unknown_after))
        self.nonces: dict[int, str] = {}
        self._beats: dict[str, tuple[str | None, float]] = {}  # nonce -> (value, when it last changed)
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._created = time.monotonic()
        self.lives = dict(lives or {})  # process -> service incarnation the barrier waits for
        self._life_read: dict[int, float] = {}  # process -> when its life record was last read
        self._state_dir = os.environ.get(protocol.FAULT_STATE_DIR)

    # -- hooks for subclasses ------------------------------------------------------------
    def _arriving(self, key: str, n: int) -> None:
        """Called before this process arrives at the ``n``-th (from 0) barrier ``key``;
        raise :attr:`abandoned_error` to give up instead of arriving."""

    def _passed(self, key: str, n: int) -> None:
        """Called once every process arrived at the ``n``-th barrier ``key``."""

    # -- the barrier -----------------------------------------------------------------------
    def _life_over(self, c: Any, process: int, now: float) -> str | None:
        """Why the missing member's life in :attr:`lives` is over (its record read at most every
        0.2 s per member; learns its heartbeat nonce from it)."""
        if now - self._life_read.get(process, -1.0) < 0.2:
            return None
        self._life_read[process] = now
        life = lives_lib.current(c, process)
        why = lives_lib.over(life, self.lives[process], self._state_dir)
        if why is None and life is not None:
            with self._lock:
                self.nonces.setdefault(process, life.nonce)
        return why

    def _dead(self, c: Any, process: int, now: float) -> str | None:
        if process in self.lives:
            why = self._life_over(c, process, now)
            if why is not None:
                return why
        nonce = self.nonces.get(process)
        if nonce is None:
            if now - self._created > self.unknown_after_s:
                return (f"process {process} reached no barrier of this {self.options.what} in "
                        f"{self.unknown_after_s:.0f} s ({self.timeouts.describe(self.options.unknown_after)})")
            return None
        value = try_get(Heartbeat.key(nonce), c)
        with self._lock:
            last, since = self._beats.get(nonce, (None, now))
            if value != last or nonce not in self._beats:
                self._beats[nonce] = (value, now)
                return None
        if now - since > self.dead_after_s:
            return (f"process {process} stopped heartbeating {now - since:.1f} s ago "
                    f"({self.timeouts.describe(self.options.dead_after)})")
        return None

    def gone(self, process: int) -> str | None:
        """Why member ``process`` is dead, by the barrier's own signs (see the class docstring), or None."""
        return self._dead(client(), process, time.monotonic())

    def _cancel_reason(self, missing: frozenset[int] | None) -> str:
        """Why a barrier whose ``cancel`` is set gives up: the dead the canceller named
        (:class:`jaxft.worker.deaths.Canceller`), else those still missing, else no names."""
        dead = getattr(self.cancel, "dead", None) or missing
        if dead:
            return f"processes {sorted(dead)} died before arriving"
        return f"{self.options.what} abandoned"

    def _cancelled(self, key: str, missing: frozenset[int] | None) -> Exception:
        """The error of a barrier whose ``cancel`` is set (see :meth:`_cancel_reason`)."""
        return self.abandoned_error(f"barrier {key}: {self._cancel_reason(missing)}")

    def _poll(self, c: Any, base: str) -> tuple[set[int], str | None]:
        """The processes that arrived at the barrier instance ``base`` and its decision (None
        while undecided), in one read; learns the arrivals' heartbeat nonces."""
        arrived: set[int] = set()
        decision = None
        for k, v in c.key_value_dir_get(base):
            name = k.rstrip("/").rsplit("/", 1)[-1]
            if name == DECISION:
                decision = v
                continue
            p = int(name)
            arrived.add(p)
            with self._lock:
                self.nonces.setdefault(p, v)
        return arrived, decision

    def _give_up(self, c: Any, missing: frozenset[int], timeout_ms: int,
                 deadline: float) -> tuple[type[Exception], str] | None:
        """Why to stop waiting for ``missing`` (the error type and the reason), or None."""
        if self.cancel.is_set():
            return self.abandoned_error, self._cancel_reason(missing)
        given_up = c.key_value_dir_get(f"{self.namespace}/abandoned/")
        if given_up:
            k, why = given_up[0]
            who = k.rstrip("/").rsplit("/", 1)[-1]
            return self.abandoned_error, f"process {who} abandoned the {self.options.what} ({why})"
        now = time.monotonic()
        for p in sorted(missing):
            why = self._dead(c, p, now)
            if why is not None:
                return self.abandoned_error, why
        if now > deadline:
            return BarrierTimeout, (f"processes {sorted(missing)} did not arrive within {timeout_ms / 1000:.0f} s "
                                    f"({self.timeouts.describe(self.options.timeout_name)})")
        return None

    def _decide(self, c: Any, base: str, wanted: str) -> tuple[str, bool]:
        """The instance's decision, and whether it is this process's: ``wanted`` if this process
        creates the decision key first, else what the first writer put there (so every member
        gets one outcome)."""
        if _compat.create_key(c, base + DECISION, wanted):
            return wanted, True
        decided = try_get(base + DECISION, c)
        if decided is None:  # (deleted meanwhile, or the service unreachable)
            logger.warning("barrier %s: cannot read its decision; going by this process's own (%s)", base, wanted)
            return wanted, True
        return decided, False

    def _follow(self, key: str, n: int, decision: str) -> None:
        """Pass (``decision`` is :data:`PASS`), or raise :attr:`abandoned_error` with the reason
        of the member that decided to give up."""
        if decision == PASS:
            self._passed(key, n)
            return
        raise self.abandoned_error(f"barrier {key}: {decision.removeprefix(ABANDONED)}")

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        if self.processes <= {self.me}:
            return
        if self.cancel.is_set():
            raise self._cancelled(key, None)
        c = client()
        nonce = Heartbeat.get().nonce
        with self._lock:
            n = self._counts.get(key, 0)
            self._counts[key] = n + 1
            self.nonces[self.me] = nonce
        self._arriving(key, n)
        base = f"{self.namespace}/{key}/{n}/"
        c.key_value_set(base + str(self.me), nonce, allow_overwrite=True)
        deadline = time.monotonic() + max(timeout_ms, 1) / 1000
        delay = self.options.poll_s
        try:
            while True:
                arrived, decision = self._poll(c, base)
                missing = self.processes - arrived
                if decision is None and not missing:
                    decision, _ = self._decide(c, base, PASS)
                elif decision is None:
                    give_up = self._give_up(c, missing, timeout_ms, deadline)
                    if give_up is not None:
                        error, why = give_up
                        decision, mine = self._decide(c, base, f"{ABANDONED}{why[:300]} (process {self.me} gave up)")
                        if mine:
                            raise error(f"barrier {key}: {why}")
                if decision is not None:
                    self._follow(key, n, decision)
                    return
                time.sleep(delay)
                delay = min(delay * 1.5, self.options.max_poll_s)
        except (self.abandoned_error, TimeoutError) as e:
            self.abandon(str(e))
            raise

    def abandon(self, reason: str) -> None:
        """Tell the other members this process gave up (they stop waiting for it)."""
        if self.processes <= {self.me}:
            return
        try:
            client().key_value_set(f"{self.namespace}/abandoned/{self.me}", reason[:300], allow_overwrite=True)
        except Exception:  # noqa: BLE001 - best effort; the others still have heartbeats and timeouts
            pass

    def delete_keys(self) -> None:
        """Remove this barrier's keys (housekeeping once every member is past them)."""
        delete_dir(self.namespace)


def delete_dir(namespace: str) -> None:
    """Best-effort removal of every key under ``namespace/``."""
    try:
        client().key_value_delete(f"{namespace}/")
    except Exception:  # noqa: BLE001 - housekeeping only
        pass

"""How a worker leaves: on SIGTERM, on a configuration error, and, for a process 0 that hosts
the coordination service, only after its peers.

:func:`jaxft.initialize` installs these. SIGTERM ends the worker (exit 143) instead of JAX's
preemption notice, unless a clean stop with a last checkpoint is wanted
(:mod:`jaxft.worker.stopping`); an uncaught :class:`~jaxft.errors.ConfigError` is one line and
:data:`~jaxft.protocol.EXIT_CONFIG_ERROR`, never a traceback a restart would repeat.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from jaxft import _compat
from jaxft.errors import ConfigError
from jaxft.protocol import EXIT_CONFIG_ERROR
from jaxft.timeouts import Timeouts
from jaxft.worker import stopping

logger = logging.getLogger(__name__)


def install_stop_handlers() -> None:
    """SIGTERM ends the worker (exit 143) instead of JAX's preemption notice, which only
    records it, so a launcher's clean stop does not wait for its SIGKILL; an uncaught
    :class:`~jaxft.errors.ConfigError` ends it with one line and :data:`EXIT_CONFIG_ERROR`."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    if not getattr(sys.excepthook, "_jaxft", False):
        previous = sys.excepthook

        def hook(exc_type, exc, tb):
            if issubclass(exc_type, ConfigError):
                sys.stderr.write(f"jaxft: configuration error ({exc_type.__name__}): {exc}\n")
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(EXIT_CONFIG_ERROR)
            previous(exc_type, exc, tb)

        hook._jaxft = True  # type: ignore[attr-defined]
        sys.excepthook = hook


def _on_sigterm(signum, _frame) -> None:
    if stopping.wanted():  # save a last checkpoint at an agreed step first (jaxft.worker.stopping)
        stopping.request()
        return
    raise SystemExit(128 + signum)


LEAVING_PREFIX = "jaxft/leaving/"


def announce_leaving(process_id: int) -> None:
    """At exit of a peer of a process 0 that hosts the service (atexit runs this before jax's
    own shutdown, registered at its import): tell process 0 this process is about to disconnect."""
    client = _compat.distributed_client_or_none()
    if client is not None:
        try:
            client.key_value_set(f"{LEAVING_PREFIX}{process_id}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the service is already gone: nothing to wait for
            pass


def outlive_peers(num_processes: int, timeouts: Timeouts) -> Callable[[], None]:
    """For a process 0 that hosts the service: an atexit hook that keeps it (and the service)
    alive until every other process has disconnected, bounded by ``Timeouts.shutdown``. A
    peer whose service is gone aborts (SIGABRT) in its own ``ShutdownTask``, and a recoverable
    service has no shutdown barrier of its own.

    The wait runs in a thread started now, not at exit: Python 3.12 refuses to start a thread
    once the interpreter is finalizing ("can't create new thread at interpreter shutdown"),
    which had left process 0 not waiting at all there. The peers first announce that they are
    leaving (their own atexit hook), so process 0's liveness query cannot pair with a peer
    that is still training; then ``get_live_nodes`` over every process returns once each peer
    has disconnected (it waits for the live ones, and a peer in shutdown never queries)."""
    client = _compat.distributed_client_or_none()
    exiting = threading.Event()

    def wait() -> None:
        exiting.wait()
        if client is None:
            return
        deadline = time.monotonic() + timeouts.shutdown
        others, left = {str(p) for p in range(1, num_processes)}, set()
        while time.monotonic() < deadline:
            try:
                left = {k.rstrip("/").rsplit("/", 1)[-1] for k, _ in client.key_value_dir_get(LEAVING_PREFIX)}
            except Exception:  # noqa: BLE001 - the service or this client is already gone
                return
            if others <= left:
                break
            time.sleep(0.02)
        else:
            logger.debug("process(es) %s did not announce their exit within %.1f s",
                         sorted(others - left, key=int), timeouts.shutdown)
            return
        try:
            client.get_live_nodes(list(range(num_processes)))
        except Exception:  # noqa: BLE001 - the service or this client is already gone
            pass

    waiter = threading.Thread(target=wait, name="jaxft-outlive-peers", daemon=True)
    waiter.start()

    def at_exit() -> None:
        exiting.set()
        waiter.join(timeouts.shutdown)

    return at_exit

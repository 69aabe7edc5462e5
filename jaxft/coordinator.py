"""A standalone, recoverable JAX coordination service.

With plain ``jax.distributed.initialize`` process 0 hosts the coordination service, so
its death kills the job. Running the service in its own small process (``jaxft
coordinator``, or inside ``jaxft launch``) makes every worker, process 0 included,
expendable. The service factory is private jax API (reached through :mod:`jaxft._compat`).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from jaxft import _compat
from jaxft.errors import CoordinatorError
from jaxft.net import check_port_free, format_address, free_port
from jaxft.timeouts import Timeouts

DEFAULT_HEARTBEAT_TIMEOUT = int(Timeouts.heartbeat)
DEFAULT_SHUTDOWN_TIMEOUT = int(Timeouts.shutdown)


class Coordinator:
    """The recoverable coordination service for ``num_processes`` workers.

    Binds ``bind:port`` (loopback by default). ``port=0`` picks a free port. Use as a
    context manager or call :meth:`shutdown`.
    """

    def __init__(self, num_processes: int, port: int = 0, bind: str = "127.0.0.1",
                 heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT,
                 shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT):
        if num_processes < 1:
            raise CoordinatorError(f"--num-processes must be >= 1, got {num_processes}")
        if heartbeat_timeout < 1:
            raise CoordinatorError(f"heartbeat timeout must be >= 1 s, got {heartbeat_timeout}")
        try:
            self.port = port or free_port(bind.strip("[]"))
        except OSError as e:
            raise CoordinatorError(f"cannot bind {bind}: {e.strerror or e}") from None
        check_port_free(bind, self.port)
        self.bind = bind
        self.num_processes = num_processes
        self._service: Any = _compat.start_service(
            format_address(bind, self.port), num_processes,
            heartbeat_timeout=int(heartbeat_timeout), shutdown_timeout=int(shutdown_timeout))

    @property
    def address(self) -> str:
        """The address workers connect to (loopback when bound to all interfaces)."""
        host = self.bind.strip("[]")
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return format_address(host, self.port)

    def shutdown(self) -> None:
        if self._service is not None:
            self._service.shutdown()
            self._service = None

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def serve_forever(coordinator: Coordinator, announce: str | None = None) -> None:
    """Block until SIGINT or SIGTERM, then shut the service down. ``announce`` is printed
    once the signal handlers are in place (a SIGTERM right after it still stops cleanly)."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    if announce is not None:
        print(announce, flush=True)
    try:
        while not done.wait(0.5):
            pass
    finally:
        coordinator.shutdown()

"""A standalone, recoverable JAX coordination service.

With plain ``jax.distributed.initialize`` process 0 hosts the coordination service, so
its death kills the job. Running the service in its own small process (``jaxft
coordinator``, or inside ``jaxft launch``) makes every worker, process 0 included,
expendable. The service factory is private jax API (reached through :mod:`jaxft._compat`).
"""

from __future__ import annotations

import errno
import signal
import socket
import threading
import time
from typing import Any

from jaxft import _compat
from jaxft.errors import CoordinatorError
from jaxft.timeouts import Timeouts

DEFAULT_HEARTBEAT_TIMEOUT = int(Timeouts.heartbeat)
DEFAULT_SHUTDOWN_TIMEOUT = int(Timeouts.shutdown)


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`CoordinatorError` if ``host:port`` cannot be bound right now."""
    if not 0 < port < 65536:
        raise CoordinatorError(f"port {port} is out of range 1..65535")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise CoordinatorError(f"port {port} on {host} is already in use; pick another "
                                       "with --port (or 0 for a free one)") from None
            raise CoordinatorError(f"cannot bind {host}:{port}: {e.strerror}") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` at the time of asking."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def wait_reachable(address: str, timeout: float) -> str | None:
    """Poll a TCP connection to ``host:port`` for up to ``timeout`` seconds.

    Returns None once it connects, else why the last attempt failed (no exception, so each
    caller raises its own error: the launcher's, or initialize()'s).
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return f"{address!r} is not host:port"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return None
        except OSError as e:
            if time.monotonic() >= deadline:
                return e.strerror or str(e)
            time.sleep(0.2)


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

    def __enter__(self) -> "Coordinator":
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

"""Addresses and ports: the checks both programs make before they use the network.

The launcher checks a port before it hosts the coordination service and an interface before
it hands it to gloo; a worker waits for the service's port before it connects (a clear
error instead of jax's abort when the coordinator never answers).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import time

from jaxft.errors import CoordinatorError


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


def interface_problem(name: str) -> str | None:
    """Why ``name`` cannot be gloo's interface on this host (None when it exists)."""
    names = [n for _, n in socket.if_nameindex()]
    if name in names:
        return None
    return f"network interface {name!r} does not exist on this host (it has: {', '.join(names)})"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) is a loopback one."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host in ("localhost",)



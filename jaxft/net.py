"""Addresses and ports: the checks both programs make before they use the network.

The launcher checks a port before it hosts the coordination service and an interface before
it hands it to gloo; a worker waits for the service's port before it connects (a clear
error instead of jax's abort when the coordinator never answers).
"""

from __future__ import annotations

import errno
import ipaddress
import random
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


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
FALLBACK_EPHEMERAL = (32768, 60999)  # Linux's default, where the file cannot be read


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` at the time of asking, outside the kernel's ephemeral
    range where one can be found there.

    A port the kernel hands out for a bind to port 0 comes from the range it also gives every
    outgoing connection, and is free again once the socket closes: any connection made before
    the service binds it can take it (seen in CI with two test workers: the coordination
    service failed to add its port and its process died with SIGSEGV). A port below that range
    is taken only by a process that asks for it by number.
    """
    low, _ = _ephemeral_range()
    candidates = range(max(1024, low - 16384), low)
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open(EPHEMERAL_RANGE) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return FALLBACK_EPHEMERAL


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



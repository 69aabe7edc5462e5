"""jaxft.breaker: which connections a failed collective shuts down, with real sockets."""

import socket

import pytest

from jaxft import breaker

pytestmark = pytest.mark.smoke


def pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    """A connected (client, accepted) pair through ``listener``."""
    client = socket.create_connection(listener.getsockname()[:2], timeout=5)
    accepted, _ = listener.accept()
    accepted.settimeout(5)
    return client, accepted


def listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_break_shuts_the_data_plane_and_spares_the_service(monkeypatch):
    service, plane = listening(), listening()  # the coordination service's port; a gloo-like listener
    monkeypatch.setattr(breaker, "_protected_ports", set())
    breaker.protect(f"127.0.0.1:{service.getsockname()[1]}")
    to_service, service_side = pair(service)
    out, into = pair(plane)  # this process both initiated and accepted a data-plane connection
    try:
        fds = set(breaker.data_plane_fds())
        assert {out.fileno(), into.fileno()} <= fds
        assert not {to_service.fileno(), service_side.fileno()} & fds
        assert breaker.break_data_plane() >= 2
        # the peers of a shut connection read end-of-file at once (a pending gloo receive fails)
        assert out.recv(1) == b"" and into.recv(1) == b""
        # the coordination service's connection still carries data, both ways
        to_service.sendall(b"ping")
        assert service_side.recv(4) == b"ping"
        service_side.sendall(b"pong")
        assert to_service.recv(4) == b"pong"
    finally:
        for s in (service, plane, to_service, service_side, out, into):
            s.close()


def test_without_a_known_service_port_nothing_is_touched(monkeypatch):
    monkeypatch.setattr(breaker, "_protected_ports", set())
    plane = listening()
    out, into = pair(plane)
    try:
        assert breaker.break_data_plane() == 0
        out.sendall(b"x")
        assert into.recv(1) == b"x"
    finally:
        for s in (plane, out, into):
            s.close()


def test_collective_failures_are_told_from_other_errors():
    assert breaker.is_collective_failure(RuntimeError("UNKNOWN: Gloo all-reduce failed: ... Connection reset"))
    assert not breaker.is_collective_failure(ValueError("loss_fn must return one loss per example"))
    assert not breaker.is_collective_failure(None)

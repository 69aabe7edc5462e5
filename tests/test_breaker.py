"""jaxft.worker.breaker: which connections a failed collective shuts down, with real sockets."""

import socket

import pytest
from helpers import PYTHON, REPO, by_event, events, launch

from jaxft.worker import breaker

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


def advertise(monkeypatch, *listeners: socket.socket) -> None:
    """Make ``listeners`` what gloo's rendezvous records advertise (and forget earlier reads)."""
    known = {breaker.Endpoint(*s.getsockname()[:2]) for s in listeners}
    monkeypatch.setattr(breaker, "_advertised", lambda: set(known))
    monkeypatch.setattr(breaker, "_learned", frozenset())


def carries_data(a: socket.socket, b: socket.socket) -> bool:
    a.sendall(b"ping")
    b.sendall(b"pong")
    return b.recv(4) == b"ping" and a.recv(4) == b"pong"


def test_break_shuts_the_data_plane_and_spares_the_service(monkeypatch):
    service, plane = listening(), listening()  # the coordination service's port; a gloo listener
    user = listening()  # the program's own server, on a high port
    monkeypatch.setattr(breaker, "_protected_ports", set())
    breaker.protect(f"127.0.0.1:{service.getsockname()[1]}")
    advertise(monkeypatch, plane)
    to_service, service_side = pair(service)
    out, into = pair(plane)  # this process both initiated and accepted a data-plane connection
    to_user, user_side = pair(user)
    try:
        fds = set(breaker.data_plane_fds())
        assert {out.fileno(), into.fileno()} <= fds
        assert not {to_service.fileno(), service_side.fileno(), to_user.fileno(), user_side.fileno()} & fds
        assert breaker.break_data_plane() >= 2
        # the peers of a shut connection read end-of-file at once (a pending gloo receive fails)
        assert out.recv(1) == b"" and into.recv(1) == b""
        # the coordination service's connection and the program's own still carry data, both ways
        assert carries_data(to_service, service_side)
        assert carries_data(to_user, user_side)
    finally:
        for s in (service, plane, user, to_service, service_side, out, into, to_user, user_side):
            s.close()


def test_what_was_learnt_of_a_backend_outlives_its_records(monkeypatch):
    # A rebuild deletes gloo's records while the old backend's pairs still exist: while its
    # listener lives, the endpoints read before still count; a new backend's do not inherit them.
    plane = listening()
    advertise(monkeypatch, plane)
    here = breaker.Endpoint(*plane.getsockname()[:2])
    assert breaker.gloo_endpoints({here}) == {here}
    monkeypatch.setattr(breaker, "_advertised", lambda: None)  # the records are gone (or unreadable)
    assert breaker.gloo_endpoints({here}) == {here}
    plane.close()  # that backend is gone
    assert breaker.gloo_endpoints(set()) == frozenset()


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


def test_a_break_ends_the_collective_and_spares_the_programs_own_connections(tmp_path):
    # Process 1 breaks its data plane while process 0 waits for it in an all-reduce: process 0's
    # all-reduce fails at once, and process 1's own connection (a client of a server it runs on
    # a high port, and the connection that server accepted) still carries data. Every such
    # connection used to be shut down too.
    r = launch(2, [PYTHON, str(REPO / "tests" / "workers" / "breaker_user.py")], "--collective-timeout", "30",
               run_dir=tmp_path, timeout=120)
    logged = {e["process"]: e for e in by_event(events(tmp_path), "breaker")}
    assert sorted(logged) == [0, 1], r.describe()
    assert logged[1]["own_connection"] is True, logged
    assert logged[1]["broke"] >= 1, logged
    assert breaker.is_collective_failure(RuntimeError(logged[0]["ended"])), logged
    assert logged[0]["seconds"] < 10, logged  # ended by the break, not by the 30 s collective timeout

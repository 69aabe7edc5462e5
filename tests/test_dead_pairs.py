"""jaxft.worker.deadpairs and the epoll calls under it: a closed connection that an event loop
keeps watching level-triggered is reported ready at every wait (gloo's loop then spins a core);
disarmed, it is reported at most once more, stays removable, and live connections are untouched.
Real sockets and a real epoll instance in this process; gloo's own loop is checked in
tests/test_private_api.py (its pairs are found there, watched level-triggered)."""

import select
import socket

import pytest

from jaxft import _compat
from jaxft.worker import breaker, deadpairs

pytestmark = pytest.mark.smoke


def inode(s: socket.socket) -> int:
    return next(i for i, fd in breaker.my_sockets().items() if fd == s.fileno())


def connected(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname()[:2], timeout=5)
    accepted, _ = listener.accept()
    return client, accepted


@pytest.fixture
def loop():
    """An event loop's pieces: a listener and an epoll instance watching it, level-triggered."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    ep = select.epoll()
    ep.register(listener.fileno(), select.EPOLLIN)
    opened = [listener]
    yield ep, listener, opened
    ep.close()
    for s in opened:
        s.close()


def dead_and_live(ep: select.epoll, listener: socket.socket, opened: list) -> tuple[socket.socket, socket.socket]:
    """Two accepted connections the loop watches for input: one whose peer went, one alive."""
    gone, dead = connected(listener)
    peer, live = connected(listener)
    gone.close()
    opened += [dead, peer, live]
    for s in (dead, live):
        ep.register(s.fileno(), select.EPOLLIN)
    return dead, live


def reported(ep: select.epoll, fd: int, waits: int = 5) -> int:
    """How many of ``waits`` short waits report ``fd``."""
    return sum(any(f == fd for f, _ in ep.poll(0.02)) for _ in range(waits))


def registration(ep: select.epoll, s: socket.socket) -> _compat.Registration:
    (r,) = [r for r in _compat.registrations_of(ep.fileno()) if r.fd == s.fileno()]
    return r


def test_a_closed_connection_watched_level_triggered_is_reported_at_every_wait_until_disarmed(loop):
    ep, listener, opened = loop
    dead, live = dead_and_live(ep, listener, opened)
    r = registration(ep, dead)
    assert r in _compat.epoll_registrations() and r.inode == inode(dead)
    assert reported(ep, dead.fileno()) == 5  # what makes gloo's loop spin
    assert _compat.disarm(r)
    assert reported(ep, dead.fileno()) <= 1
    assert registration(ep, dead).events & _compat.EPOLLONESHOT
    assert reported(ep, live.fileno()) == 0
    ep.unregister(dead.fileno())  # its owner can still remove it
    assert [x for x in _compat.registrations_of(ep.fileno()) if x.fd == dead.fileno()] == []


def test_disarm_leaves_a_registration_that_changed_since_it_was_read(loop):
    ep, listener, opened = loop
    dead, _ = dead_and_live(ep, listener, opened)
    r = registration(ep, dead)
    stale = _compat.Registration(r.epoll, r.fd, r.events, r.data + 1, r.inode)  # (the descriptor reused since)
    assert not _compat.disarm(stale)
    assert reported(ep, dead.fileno()) == 5


def test_after_a_failure_a_connection_closed_at_two_commits_is_disarmed_and_live_ones_stay(loop, monkeypatch):
    ep, listener, opened = loop
    monkeypatch.setattr(breaker, "gloo_listeners", lambda table, mine: {inode(listener)})
    dead, live = dead_and_live(ep, listener, opened)
    pairs = deadpairs.DeadPairs(0)
    assert pairs.after_commit() == 0  # no failure: no look
    pairs.step_failed()
    assert pairs.after_commit() == 0  # closed at one commit: possibly one gloo is about to close
    assert reported(ep, dead.fileno()) == 5
    assert pairs.after_commit() == 1  # still there one commit later: not one of the members' own
    assert reported(ep, dead.fileno()) <= 1 and pairs.disarmed == 1
    opened[2].sendall(b"x")  # (the live connection's peer) still reported as gloo needs it
    assert reported(ep, live.fileno()) == 5
    monkeypatch.setattr(breaker, "tcp_sockets", lambda mine=None: pytest.fail("looked with nothing left to quiet"))
    assert pairs.after_commit() == 0


def test_a_closed_connection_its_owner_removes_between_commits_is_left_alone(loop, monkeypatch):
    ep, listener, opened = loop
    monkeypatch.setattr(breaker, "gloo_listeners", lambda table, mine: {inode(listener)})
    dead, _ = dead_and_live(ep, listener, opened)
    pairs = deadpairs.DeadPairs(0)
    pairs.step_failed()
    assert pairs.after_commit() == 0
    ep.unregister(dead.fileno())  # what a loop that handles the close does
    dead.close()
    assert pairs.after_commit() == 0 and pairs.disarmed == 0


def test_only_the_loop_that_watches_gloos_listener_is_touched(loop, monkeypatch):
    ep, listener, opened = loop
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    opened.append(other)
    monkeypatch.setattr(breaker, "gloo_listeners", lambda table, mine: {inode(other)})  # gloo's is elsewhere
    dead, _ = dead_and_live(ep, listener, opened)
    pairs = deadpairs.DeadPairs(0)
    pairs.step_failed()
    assert pairs.after_commit() == 0 and pairs.after_commit() == 0
    assert reported(ep, dead.fileno()) == 5


def test_a_replaced_backends_loop_is_looked_at_while_it_lives(loop, monkeypatch):
    # A rebuild replaces the backend; one held alive keeps its loop, whose connections die as the
    # peers free theirs: found before the rebuild, its loop is looked at after it, while it lives.
    old_ep, old_listener, opened = loop
    new_listener = socket.socket()
    new_listener.bind(("127.0.0.1", 0))
    new_listener.listen()
    new_ep = select.epoll()
    new_ep.register(new_listener.fileno(), select.EPOLLIN)
    opened.append(new_listener)
    gloo = {"listener": old_listener}
    monkeypatch.setattr(breaker, "gloo_listeners", lambda table, mine: {inode(gloo["listener"])})
    pairs = deadpairs.DeadPairs(0)
    pairs.step_failed()
    assert pairs.after_commit() == 0  # (finds the loop: nothing dead in it yet)
    pairs.backend_replaced()
    gloo["listener"] = new_listener  # the records now advertise the new backend's listener
    dead, _ = dead_and_live(old_ep, old_listener, opened)
    assert pairs.after_commit() == 0 and pairs.after_commit() == 1
    assert reported(old_ep, dead.fileno()) <= 1
    old_ep.close()  # the old backend freed
    assert pairs.gloo_registrations(breaker.tcp_sockets(), breaker.my_sockets()) == \
        _compat.registrations_of(new_ep.fileno())
    new_ep.close()

"""Fail a step's CPU collectives everywhere at once when one member sees a peer die.

gloo runs an all-reduce as a ring: when a process dies, only its neighbours' pairs see the
closed connection ("Connection reset by peer"); the other members wait for data from a live
peer that has already given up, until the collective timeout (seconds). The breaker closes
the rest of the ring at once: a member whose collective failed shuts down (``shutdown(2)``,
the descriptors stay gloo's) every TCP connection of its CPU data plane, so each peer's
pending receive from it fails in turn, and within milliseconds every member has left the
step and reached the exit query that names the dead.

Only gloo's connections are touched: those to or from an address that a gloo rendezvous
record in the coordination service advertises (every process's gloo listener, under
``cpu:gloo/...``), never the coordination service's own nor the program's other TCP
connections (a database, a metrics server, an object store). After a break the whole CPU
backend must be rebuilt (:class:`jaxft.ElasticGroup` does it at the next step); on GPU,
NCCL's own abort does this job and the breaker is never used.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from typing import NamedTuple

from jaxft import _compat

logger = logging.getLogger(__name__)

ESTABLISHED = "01"
LISTEN = "0A"
_ANY = "*"  # the address of an endpoint advertised on every interface (matches any)
_READ_TIMEOUT_S = 2.0
_protected_ports: set[int] = set()
_learned: frozenset[Endpoint] = frozenset()  # gloo's endpoints, as last read (see gloo_endpoints)


class Endpoint(NamedTuple):
    ip: str  # canonical text (an IPv4-mapped IPv6 address as IPv4), or _ANY
    port: int


class Socket(NamedTuple):
    state: str
    local: Endpoint
    remote: Endpoint


def protect(address: str | None) -> None:
    """Never touch connections to or from ``address``'s port (the coordination service)."""
    if address and ":" in address:
        try:
            _protected_ports.add(int(address.rsplit(":", 1)[1]))
        except ValueError:
            pass


def _endpoint(packed: bytes, port: int) -> Endpoint:
    """An :class:`Endpoint` of a packed IPv4 or IPv6 address."""
    ip = ipaddress.ip_address(packed)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return Endpoint(_ANY if ip.is_unspecified else str(ip), port)


def _sockname(address: tuple, family: int) -> Endpoint:
    """An :class:`Endpoint` of a socket address as ``getsockname`` gives it."""
    host = str(address[0]).split("%", 1)[0]  # (an IPv6 scope)
    return _endpoint(socket.inet_pton(family, host), int(address[1]))


def _duplicate(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of this process's descriptor ``fd`` (closing it closes the
    duplicate only; gloo's descriptor stays open); None if ``fd`` is gone or no socket."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _tcp_socket(fd: int) -> Socket | None:
    """The state and ends of the TCP socket ``fd`` of this process (None if it is no TCP socket),
    asked through a duplicate of it (the descriptor itself is left alone)."""
    s = _duplicate(fd)
    if s is None:
        return None
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
            return None
        state = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]  # (tcpi_state: the first byte)
        local = _sockname(s.getsockname(), s.family)
        try:
            remote = _sockname(s.getpeername(), s.family)
        except OSError:  # listening, or closed
            remote = Endpoint(_ANY, 0)
        return Socket(f"{state:02X}", local, remote)
    except (OSError, ValueError):
        return None
    finally:
        s.close()  # (the duplicate only)


def tcp_sockets(mine: dict[int, int] | None = None) -> dict[int, Socket]:
    """``{socket inode: Socket}`` of this process's TCP sockets (``mine``: :func:`my_sockets`,
    read here if not given; the state as ``/proc/net/tcp`` spells it, ``01`` connected).

    Each socket is asked for its state (``TCP_INFO``) and ends: a few system calls a socket.
    Reading ``/proc/net/tcp`` walks the kernel's whole connection table instead: 10-60 ms a read
    on a loaded 2-core machine, on a failure's way back (docs/benchmarks.md, session 36)."""
    out: dict[int, Socket] = {}
    for inode, fd in (my_sockets() if mine is None else mine).items():
        entry = _tcp_socket(fd)
        if entry is not None:
            out[inode] = entry
    return out


def my_sockets() -> dict[int, int]:
    """``{socket inode: file descriptor}`` of this process's sockets."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def _advertised() -> set[Endpoint] | None:
    """The endpoints gloo's rendezvous records advertise (every process's gloo listener), read
    from the coordination service within ``_READ_TIMEOUT_S``; None if they cannot be read."""
    client = _compat.distributed_client_or_none()
    if client is None:
        return None
    values: list[bytes] = []

    def read() -> None:
        try:
            values.extend(v for _, v in client.key_value_dir_get_bytes(_compat.GLOO_KEY_PREFIX))
        except Exception as e:  # noqa: BLE001 - the caller goes on with what it learnt before
            logger.warning("cannot read gloo's rendezvous records: %s", e)
        finally:
            done.set()

    done = threading.Event()
    threading.Thread(target=read, name="jaxft-breaker-read", daemon=True).start()
    if not done.wait(_READ_TIMEOUT_S):
        logger.warning("gloo's rendezvous records not read within %.0f s", _READ_TIMEOUT_S)
        return None
    addresses = (_compat.gloo_listen_address(v) for v in values)
    return {_endpoint(*a) for a in addresses if a is not None}


def _matches(endpoint: Endpoint, known: frozenset[Endpoint]) -> bool:
    """Whether ``endpoint`` is one of ``known`` (an address on every interface matches any)."""
    if endpoint in known or Endpoint(_ANY, endpoint.port) in known:
        return True
    return endpoint.ip == _ANY and any(k.port == endpoint.port for k in known)


def gloo_endpoints(listening: set[Endpoint]) -> frozenset[Endpoint]:
    """The endpoints of gloo's listeners (this process's and its peers'), given this process's
    listening endpoints.

    Read from the coordination service at each call (a break is rare), merged with what the
    last read learnt while that still belongs to this backend (one of its endpoints is still
    listening here): the records can be deleted for a rebuild while the old pairs still exist.
    """
    global _learned
    same_backend = any(_matches(e, _learned) for e in listening)
    fresh = _advertised()
    kept = _learned if same_backend else frozenset()
    _learned = kept | frozenset(fresh or ())
    return _learned


def _listening(table: dict[int, Socket], mine: dict[int, int]) -> dict[int, Endpoint]:
    """``{inode: local endpoint}`` of this process's listening sockets."""
    return {i: table[i].local for i in mine if i in table and table[i].state == LISTEN}


def gloo_listeners(table: dict[int, Socket], mine: dict[int, int]) -> set[int]:
    """Inodes of this process's listening sockets that gloo's rendezvous records advertise
    (``table``: :func:`tcp_sockets`, ``mine``: :func:`my_sockets`)."""
    listening = _listening(table, mine)
    gloo = gloo_endpoints(set(listening.values()))
    return {i for i, local in listening.items() if _matches(local, gloo)}


def data_plane_fds() -> list[int]:
    """File descriptors of this process's CPU data-plane connections (gloo's pairs).

    An established TCP connection counts when one of its ends is a gloo listener that gloo's
    rendezvous records advertise (see :func:`gloo_endpoints`): accepted by this process's
    gloo listener, or made to a peer's. Never one to or from the coordination service's port.
    """
    mine = my_sockets()
    table = tcp_sockets(mine)
    gloo = gloo_endpoints(set(_listening(table, mine).values()))
    fds = []
    for inode, fd in mine.items():
        entry = table.get(inode)
        if entry is None or entry.state != ESTABLISHED:
            continue
        if entry.local.port in _protected_ports or entry.remote.port in _protected_ports:
            continue
        if _matches(entry.local, gloo) or _matches(entry.remote, gloo):
            fds.append(fd)
    return fds


def break_data_plane() -> int:
    """Shut down every data-plane connection (see the module docstring); returns how many."""
    if not _protected_ports:
        return 0  # no coordination service known: no gloo peers either (and its port unprotected)
    n = 0
    for fd in data_plane_fds():
        s = _duplicate(fd)
        if s is None:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.close()  # closes our duplicate only; gloo's descriptor stays open, its connection shut
    logger.info("broke %d data-plane connections", n)
    return n


def is_collective_failure(error: BaseException | None) -> bool:
    """Whether ``error`` is a CPU collective that failed (a peer died or broke its connections)."""
    return error is not None and "Gloo" in str(error)

"""Fail a step's CPU collectives everywhere at once when one member sees a peer die.

gloo runs an all-reduce as a ring: when a process dies, only its neighbours' pairs see the
closed connection ("Connection reset by peer"); the other members wait for data from a live
peer that has already given up, until the collective timeout (seconds). The breaker closes
the rest of the ring at once: a member whose collective failed shuts down (``shutdown(2)``,
the descriptors stay gloo's) every TCP connection of its CPU data plane, so each peer's
pending receive from it fails in turn, and within milliseconds every member has left the
step and reached the exit query that names the dead.

Only data-plane connections are touched: every established TCP connection of this process
except those to or from the coordination service's port. After a break the whole CPU
backend must be rebuilt (:class:`jaxft.ElasticGroup` does it at the next step); on GPU,
NCCL's own abort does this job and the breaker is never used.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)

_ESTABLISHED = "01"
_LISTEN = "0A"
_protected_ports: set[int] = set()


def protect(address: str | None) -> None:
    """Never touch connections to or from ``address``'s port (the coordination service)."""
    if address and ":" in address:
        try:
            _protected_ports.add(int(address.rsplit(":", 1)[1]))
        except ValueError:
            pass


def _tcp_sockets() -> dict[int, tuple[str, int, int]]:
    """``{socket inode: (state, local port, remote port)}`` of the TCP sockets in this namespace."""
    out: dict[int, tuple[str, int, int]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) >= 10:
                        out[int(cols[9])] = (cols[3], int(cols[1].rsplit(":", 1)[1], 16),
                                             int(cols[2].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return out


def _my_sockets() -> dict[int, int]:
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


def data_plane_fds() -> list[int]:
    """File descriptors of this process's CPU data-plane connections (gloo's pairs).

    An established TCP connection counts unless one end is the coordination service's port;
    and it must either have been accepted by one of this process's listeners (gloo listens
    on an ephemeral port) or lead to an unprivileged port (gloo's peers listen on ephemeral
    ports; HTTPS to a checkpoint store does not).
    """
    table, mine = _tcp_sockets(), _my_sockets()
    listening = {table[i][1] for i in mine if i in table and table[i][0] == _LISTEN} - _protected_ports
    fds = []
    for inode, fd in mine.items():
        entry = table.get(inode)
        if entry is None or entry[0] != _ESTABLISHED:
            continue
        _, local, remote = entry
        if local in _protected_ports or remote in _protected_ports:
            continue
        if local in listening or remote >= 1024:
            fds.append(fd)
    return fds


def break_data_plane() -> int:
    """Shut down every data-plane connection (see the module docstring); returns how many."""
    if not _protected_ports:
        return 0  # no known service port: we cannot tell gloo's connections from gRPC's
    n = 0
    for fd in data_plane_fds():
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
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

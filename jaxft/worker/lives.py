"""Lives: each incarnation of a process registers itself, so that a peer waiting for a
member can tell that member's life is over instead of waiting out a timeout.

A member map (process id -> coordination-service incarnation, as the step's liveness query
agreed it) names lives, not processes. A member that dies after the map was agreed and
before it reaches a barrier the map set up (the data-plane rebuild's) is invisible to a
barrier keyed by process id: no arrival key ever tells its heartbeat nonce, and once the
launcher restarts it, the process id looks alive again (a new heartbeat, a new launch).
Seen in CI: a rebuild's barrier waited its full 60 s (``Timeouts.reset``) for a member
killed right after its step's map was agreed, while that member's restart sat in its
own first step waiting for the rebuild to end.

:func:`register` (once per life, before its first liveness query, so every life named by
any member map has registered) writes ``jaxft/life/<process>`` = the life's service
incarnation, heartbeat nonce and launcher incarnation; a restart overwrites it.
:func:`over` then says why a life of a map is over:

* the record names another incarnation: the process restarted (the service accepted a new
  life under its id; the launcher starts one only after the old one exited);
* the launcher recorded that life's exit (:mod:`jaxft.worker.deaths`, local workers only);
* the record says the life was retired: the launcher that saw it exit gave its process a new
  incarnation in the service and wrote that one here
  (:func:`jaxft.supervisor.retire.record_retired`), so that members on other nodes, who cannot
  read its death record, stop waiting for it within a read of this record instead of a
  heartbeat timeout;
* otherwise nothing is known here; with the nonce (:attr:`Life.nonce`) a waiter can watch
  the life's heartbeat, which catches host deaths too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
from typing import Any

from jaxft import protocol, standby

PREFIX = protocol.LIFE_PREFIX
_IMPORTED_AT = time.time()


@dataclasses.dataclass(frozen=True)
class Life:
    """One incarnation of a process, as it registered itself."""

    process: int
    incarnation: int  # the coordination service's (what member maps hold)
    nonce: str  # its heartbeat's (jaxft.worker.kv.Heartbeat)
    launch: int | None  # the launcher's incarnation (JAXFT_INCARNATION); None outside jaxft launch
    retired: bool = False  # written by the launcher's helper for a dead life (record_retired)


def register(client: Any | None = None) -> Life:
    """Register this process's current life (one liveness query over itself and one write)."""
    import jax

    from jaxft.worker import kv

    c = client if client is not None else kv.client()
    me = jax.process_index()
    # a query over this process alone is answered at once, with its own incarnation
    incarnation = int(c.get_live_nodes([me])[me])
    launch = os.environ.get(protocol.INCARNATION)
    life = Life(me, incarnation, kv.Heartbeat.get().nonce, int(launch) if launch and launch.isdigit() else None)
    c.key_value_set(f"{PREFIX}{me}", protocol.life_record(life.incarnation, life.nonce, life.launch),
                    allow_overwrite=True)
    return life


def current(client: Any, process: int) -> Life | None:
    """The newest registered life of ``process`` (None if none registered)."""
    from jaxft.worker import kv  # (kv imports this module)

    return _parse(process, kv.try_get(f"{PREFIX}{process}", client))


def all_current(client: Any | None = None) -> dict[int, Life]:
    """The newest registered life of every process that registered one (one read; empty when
    the service cannot be reached)."""
    from jaxft.worker import kv

    out = {}
    for key, value in kv.try_dir_get(PREFIX, client):
        name = key.rstrip("/").rsplit("/", 1)[-1]
        life = _parse(int(name), value) if name.isdigit() else None
        if life is not None:
            out[life.process] = life
    return out


def _parse(process: int, value: str | None) -> Life | None:
    if not value:
        return None
    try:
        r = json.loads(value)
        return Life(process, int(r["incarnation"]), str(r["nonce"]), r.get("launch"), bool(r.get("retired", False)))
    except (ValueError, KeyError, TypeError):
        return None


def over(life: Life | None, incarnation: int, state_dir: str | None = None) -> str | None:
    """Why the life ``incarnation`` of ``life.process`` is over (``life``: what
    :func:`current` read), or None when nothing here says so."""
    if life is None:
        return None
    local = bool(state_dir and life.launch is not None
                 and protocol.death_recorded(state_dir, life.process, life.launch))  # (one read)
    if life.incarnation != incarnation:
        if local and protocol.life_marked(str(state_dir), protocol.CONNECTED, life.process, int(life.launch or 0) + 1):
            # the record's own life died and a later one connected: the map may name that one,
            # named in an answer before it registered (jaxft.core.coldstart); nothing known here
            return None
        if not life.retired:
            return f"process {life.process} restarted (a new life registered; the one in this member map is over)"
    elif life.retired:  # (the placeholder life itself: it never heartbeats)
        return f"process {life.process}'s life was retired by its launcher"
    if local:  # (a local worker's retired life is said alike)
        return f"the launcher recorded process {life.process}'s exit"
    if life.retired:
        return f"process {life.process}'s launcher saw it exit (it retired that life in the service)"
    return None


def process_started_at() -> float:
    """When this life's process started (epoch seconds; Linux ``/proc``, to ~10 ms after the boot
    time's second), else when this module was first imported; for a standby interpreter that
    became this life (:mod:`jaxft.standby`), when it did."""
    handed = os.environ.get(standby.LIFE_STARTED)
    if handed:
        with contextlib.suppress(ValueError):
            return float(handed)
    started = started_at("self")
    return _IMPORTED_AT if started is None else started


def started_at(pid: int | str) -> float | None:
    """When the local process ``pid`` (or ``"self"``) started, in epoch seconds, up to a second
    early (the boot time is whole seconds); None where ``/proc`` does not say (no such process,
    not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def local_process_gone(owner: str, since: float) -> bool:
    """Whether the process ``owner`` names (``"host pid"``) is known to be dead: on this host,
    no such process, or one that started after ``since`` (epoch seconds: its pid reused). On
    another host nothing is known (False)."""
    host, _, pid = owner.partition(" ")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    started = started_at(int(pid))
    return started is not None and started > since + 1.0  # (started_at may be a second early)

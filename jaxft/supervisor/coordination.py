"""The launcher and the coordination service: host it, or dial one elsewhere and notice when
it goes away (:class:`ServiceLink`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jaxft.coordinator import Coordinator
from jaxft.errors import LaunchError
from jaxft.events import EventLog
from jaxft.net import wait_reachable
from jaxft.protocol import Event
from jaxft.supervisor.console import Console
from jaxft.supervisor.launch_config import Topology
from jaxft.timeouts import Timeouts


class ServiceLink:
    """The service this launcher's workers dial: one it hosts (:meth:`serve`), or an external
    one whose loss holds restarts until it answers again (:meth:`note_if_lost`, :meth:`back`)."""

    def __init__(self, topology: Topology, timeouts: Timeouts, console: Console, events: EventLog):
        self.topology, self.timeouts, self.console, self.events = topology, timeouts, console, events
        self.service = topology.service
        self.lost_since: float | None = None  # when the external coordinator stopped answering

    @property
    def lost(self) -> bool:
        return self.lost_since is not None

    def _external_address(self) -> str | None:
        """The address of an external service (:attr:`Service.external`); None: one hosted here."""
        s = self.service
        return s.address if s.external else None

    def check_reachable(self) -> None:
        """An external service must answer before anything starts (``Timeouts.initialization``)."""
        address = self._external_address()
        if address is None:
            return
        why = wait_reachable(address, self.timeouts.initialization)
        if why is not None:
            raise LaunchError(f"node {self.topology.node_rank}: cannot reach the coordinator at {address} within "
                              f"{self.timeouts.describe('initialization')} ({why}); start jaxft coordinator "
                              "(or the agent with --host-coordinator) first, and check the address")

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        """The address the workers dial: a service this launcher hosts, or one elsewhere."""
        s = self.service
        external = self._external_address()
        if external is not None:
            yield external
            return
        port, bind = s.port, s.bind
        if s.address:  # --host-coordinator: serve at --coordinator's port, on --bind (default: all)
            port = int(s.address.rpartition(":")[2])
            bind = bind or "0.0.0.0"
        with Coordinator(self.topology.total_processes, port=port, bind=bind or "127.0.0.1",
                         heartbeat_timeout=int(self.timeouts.heartbeat),
                         shutdown_timeout=int(self.timeouts.shutdown)) as coordinator:
            yield s.address or coordinator.address

    def note_if_lost(self, now: float) -> None:
        """Before a restart: if the external service does not answer, every worker dies with it;
        from now on restarts wait until it is back (:meth:`back`)."""
        address = self._external_address()
        if address is not None and self.lost_since is None and wait_reachable(address, 0.5) is not None:
            self.lost_since = now
            self.console.warn(f"the coordinator at {address} does not answer; holding restarts until it does "
                              f"(at most {self.timeouts.describe('initialization')})")
            self.events.log(Event.COORDINATOR_LOST, coordinator=address, source="launcher")

    def reachable(self) -> bool:
        """Whether the service answers now (one this launcher hosts always does)."""
        address = self._external_address()
        return address is None or wait_reachable(address, 0.5) is None

    def back(self, now: float) -> bool:
        """While the external coordinator is lost, hold restarts until it answers again, for
        at most ``Timeouts.initialization``; False when that bound ran out."""
        if self.lost_since is None:
            return True
        address = self._external_address()
        assert address is not None, "only an external coordinator is ever lost (note_if_lost)"
        if wait_reachable(address, 0.2) is None:
            self.console.warn(f"coordinator at {address} is back after {now - self.lost_since:.1f} s; "
                              "restarting the workers (they restore the latest checkpoint)")
            self.events.log(Event.COORDINATOR_BACK, after_s=round(now - self.lost_since, 3), source="launcher")
            self.lost_since = None
            return True
        if now - self.lost_since > self.timeouts.initialization:
            self.console.warn(f"lost the coordinator at {address}: no answer for "
                              f"{self.timeouts.describe('initialization')}; giving up")
            self.events.log(Event.COORDINATOR_GONE, waited_s=round(now - self.lost_since, 3), source="launcher")
            return False
        return True

"""Several real "hosts" on one machine: network namespaces with their own IPs on a bridge.

Each host is a namespace with a veth pair into a private bridge; traffic between hosts is
real TCP. A host can be cut off (:meth:`Hosts.partition`) by taking its link down, and
killed whole (:meth:`Hosts.kill`: every process inside it). Names and the subnet are
unique per test run; :meth:`Hosts.close` removes everything it made, and the context
manager calls it also when the test fails. Needs root (tests skip without it).

The hostname inside each host still resolves to loopback (no per-namespace hosts file),
as on many containers: jaxft must be told the interface (``--gloo-interface eth0``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence

import pytest


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def require_root() -> None:
    """Skip (with the reason) where namespaces cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("network-namespace hosts need root (ip netns add)")
    if subprocess.run(["which", "ip"], capture_output=True).returncode != 0:
        pytest.skip("network-namespace hosts need iproute2's `ip`")


def _free_subnet(first: int) -> int:
    """The first ``S`` from ``first`` on (mod 250) with no address in ``10.231.S.0/24`` here: two
    test workers' hosts (test_multihost.py, test_slurm.py) must not share a subnet."""
    try:
        out = _ip("-o", "-4", "addr", "show", check=False).stdout
    except OSError:  # (no iproute2: the hosts will be skipped anyway)
        out = ""
    used = {int(part.split(".")[2]) for part in out.split() if part.startswith("10.231.")}
    return next((s for s in ((first + k) % 250 for k in range(250)) if s not in used), first)


class Hosts:
    """``n`` hosts ``10.231.S.1 .. 10.231.S.n`` and the bridge at ``10.231.S.254`` (root namespace)."""

    def __init__(self, n: int):
        tag = os.getpid() % 10000
        self.subnet = f"10.231.{_free_subnet(tag % 250)}"
        self.bridge = f"jxb{tag}"
        self.names = [f"jx{tag}h{i}" for i in range(n)]
        self.links = [f"jxv{tag}h{i}" for i in range(n)]
        self.addresses = [f"{self.subnet}.{i + 1}" for i in range(n)]
        self.gateway = f"{self.subnet}.254"  # the root namespace's address on the bridge
        self._made: list[tuple[str, str]] = []

    def open(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("bridge", self.bridge))
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name, link, address in zip(self.names, self.links, self.addresses):
                _ip("netns", "add", name)
                self._made.append(("netns", name))
                _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("link", "set", link, "master", self.bridge, "up")
                _ip("netns", "exec", name, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("netns", "exec", name, "ip", "link", "set", "eth0", "up")
                _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.close()
            pytest.skip(f"cannot make network namespaces here: {' '.join(e.cmd)}: {e.stderr.strip()}")
        return self

    def command(self, host: int, args: Sequence[str]) -> list[str]:
        """``args`` run inside host ``host``."""
        return ["ip", "netns", "exec", self.names[host], *map(str, args)]

    def pids(self, host: int) -> list[int]:
        out = _ip("netns", "pids", self.names[host], check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self, host: int) -> list[int]:
        """SIGKILL every process in host ``host`` (the whole node dies at once)."""
        pids = self.pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def partition(self, host: int, cut: bool = True) -> None:
        """Cut host ``host`` off the network (``cut=False`` heals it)."""
        _ip("link", "set", self.links[host], "down" if cut else "up")

    def close(self) -> None:
        for i in range(len(self.names)):
            if ("netns", self.names[i]) in self._made:
                self.kill(i)
        deadline = time.monotonic() + 10
        while any(self.pids(i) for i, n in enumerate(self.names) if ("netns", n) in self._made):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        for link in self.links:
            _ip("link", "del", link, check=False)
        self._made.clear()


@contextlib.contextmanager
def hosts(n: int) -> Iterator[Hosts]:
    """``n`` namespace hosts, removed (processes, links, namespaces, bridge) on exit."""
    require_root()
    h = Hosts(n).open()
    try:
        yield h
    finally:
        h.close()

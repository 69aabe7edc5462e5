"""Retiring a dead worker's life in the coordination service, as soon as its launcher sees it exit.

The service counts a process alive until its heartbeat times out, and a liveness query that
the process entered before dying can still complete with it in the answer, unchanged: a
member late to that query would commit a step that the others, told of the death by the
launcher (:mod:`jaxft.worker.deaths`), already failed. So before it records a death, the launcher
gives the dead process a new incarnation in the service (:func:`jaxft._compat.retire_life`):
every later answer names that new life, and whoever gets one sees the dead life gone.

The helper also writes that new incarnation as the process's life record, marked retired
(:func:`record_retired`): members on other nodes cannot read this node's
death records, and a waiter there that reads the record sees its map's life over at once,
instead of after the heartbeat timeout.

The client doing it runs in a small helper process (:class:`Retirer`, ``python -m
jaxft.supervisor.retire ADDRESS``) that the launcher starts once: a jax client that meets an error ends
its whole process (jaxlib terminates it), which must never be the launcher. Only a life that
connected is retired (:data:`jaxft.protocol.CONNECTED`, marked by :func:`jaxft.initialize` in the
directory the launcher shares with its workers): registering a process that never
connected would wait for the service's start-up barrier.
"""

from __future__ import annotations

import functools
import logging
import select
import subprocess
import sys
import threading
import time
from typing import IO, Any

from jaxft import protocol

logger = logging.getLogger(__name__)



class Retirer:
    """The launcher's handle on the helper process that retires dead lives (see the module docstring)."""

    def __init__(self, address: str):
        self.address = address
        self._proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the helper (it imports jaxlib: a second or two, off the launcher's path); it
        takes requests once it said ``ready``."""
        from jaxft.supervisor.procs import _set_pdeathsig

        try:
            proc = subprocess.Popen([sys.executable, "-m", "jaxft.supervisor.retire", self.address],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, preexec_fn=_set_pdeathsig)
        except OSError as e:
            logger.warning("cannot start the helper that retires dead lives: %s", e)
            return
        self._proc = proc
        _, stdout = _pipes(proc)

        def wait_ready() -> None:
            if stdout.readline().strip() == "ready":
                self._ready.set()

        threading.Thread(target=wait_ready, name="jaxft-retirer-start", daemon=True).start()

    def retire(self, process_id: int, launch: int, timeout_s: float) -> str:
        """Retire ``process_id``'s current life, the launcher's incarnation ``launch``; what the
        helper said (``done`` on success), or why it could not (it died, or it was not up or did
        not answer within ``timeout_s``, which bounds the whole call)."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                return "no helper"
            deadline = time.monotonic() + timeout_s
            if not self._ready.wait(timeout_s):  # (a death in the run's first seconds: it may still import)
                return f"the helper was not ready within {timeout_s:g} s"
            stdin, stdout = _pipes(proc)
            try:
                stdin.write(f"{int(process_id)} {int(launch)}\n")
                stdin.flush()
            except OSError:
                return "the helper is gone"
            while True:
                ready, _, _ = select.select([stdout], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    self._proc = None  # (its answer would come late, out of turn: start afresh later)
                    proc.kill()
                    return f"no answer within {timeout_s:g} s"
                line = stdout.readline()
                return line.strip() if line else "the helper is gone"

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def _pipes(proc: subprocess.Popen[str]) -> tuple[IO[str], IO[str]]:
    """The helper's stdin and stdout (:meth:`Retirer.start` opens both as pipes)."""
    assert proc.stdin is not None and proc.stdout is not None, "the helper's stdin and stdout are pipes"
    return proc.stdin, proc.stdout


def main(argv: list[str]) -> int:
    """The helper: ``python -m jaxft.supervisor.retire ADDRESS``; reads ``PROCESS LAUNCH`` lines (a
    process id and the launcher's incarnation of its dead life) and answers ``done P`` (or
    ``failed P: why``) for each, once it gave that process a new incarnation and recorded it."""
    from jaxft import _compat

    address = argv[1]
    _compat.client_factory()  # (imported now: the first request pays no import)
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            process_id, launch = (int(x) for x in line.split())
        except ValueError:
            continue
        try:
            _compat.retire_life(address, process_id, then=functools.partial(record_retired, process_id, launch))
            print(f"done {process_id}", flush=True)
        except Exception as e:  # noqa: BLE001 - answered: the launcher logs it and goes on
            print(f"failed {process_id}: {str(e).splitlines()[0][:200]}", flush=True)
    return 0


def record_retired(process_id: int, launch: int, client: Any) -> int:
    """As the new incarnation ``client`` gave ``process_id`` (whose life of launcher incarnation
    ``launch`` died): write it as the process's life record, marked retired, and return it. A
    waiter that reads it sees its map's life over (:func:`jaxft.worker.lives.over`); the
    restart's own registration overwrites it (the launcher starts one only after the retire)."""
    incarnation = int(client.get_live_nodes([process_id])[process_id])  # (answered at once: itself alone)
    client.key_value_set(f"{protocol.LIFE_PREFIX}{process_id}",
                         protocol.life_record(incarnation, "", int(launch), retired=True), allow_overwrite=True)
    return incarnation


if __name__ == "__main__":
    sys.exit(main(sys.argv))

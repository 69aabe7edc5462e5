"""The launcher's standby worker: one interpreter per node started ahead, imports done, that the
next restart becomes (:mod:`jaxft.standby` has the contract and the standby's own side).

The standby waits at the lowest CPU priority the launcher can undo (nice 19: its imports barely
touch the members' steps on shared cores) and is handed the priority of the life it becomes. A
standby that died while it waited (say, the workers' interpreter cannot import jaxft) is not
started again: every restart then starts as before, and the launcher says why once.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence

from jaxft import priority
from jaxft import standby as contract
from jaxft.supervisor.procs import _set_pdeathsig

logger = logging.getLogger(__name__)


class Standby:
    """This node's standby for ``command`` (the workers' command), started with ``env()``."""

    def __init__(self, command: Sequence[str], env: Callable[[], dict[str, str]], say: Callable[[str], None],
                 state_dir: str):
        self.command = list(command)
        self.state_dir = state_dir
        self._ready = ""  # the file the waiting standby creates once its imports are done
        self.target = contract.target_of(self.command)
        self._env, self._say = env, say
        self.proc: subprocess.Popen | None = None
        self.disabled = self.target is None
        self.idle_nice = priority.lowered_nice(19)  # None: nothing the launcher could undo
        self._started = 0

    def start(self) -> None:
        """Start a standby unless one waits (or they are off)."""
        if self.disabled or (self.proc is not None and self.proc.poll() is None):
            return
        assert self.target is not None
        nice = self.idle_nice

        def preexec() -> None:
            _set_pdeathsig()
            if nice is not None:
                priority.start_niced(nice)

        self._started += 1
        self._ready = os.path.join(self.state_dir, f"standby-{self._started}.ready")
        self.proc = subprocess.Popen(
            [self.target.interpreter, "-m", "jaxft.standby", "--ready", self._ready, "--", *self.command[1:]],
            env=self._env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=preexec)

    def take(self, env: Mapping[str, str], nice: int | None) -> subprocess.Popen | None:
        """The standby, now the life with environment ``env`` at nice value ``nice`` (None: the
        launcher's); None when no standby is ready (then the caller starts the life itself; one
        still importing stays for the next restart)."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None and not os.path.exists(self._ready):
            return None
        self.proc = None
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace")[-2000:] if proc.stdout is not None else ""
            self.disabled = True
            self._say(f"the standby worker exited with status {proc.returncode} while it waited; restarts start "
                      f"without one from now on. Its output: {out.strip() or '(none)'}")
            return None
        if nice is None and self.idle_nice is not None:
            nice = os.getpriority(os.PRIO_PROCESS, 0)
        try:
            assert proc.stdin is not None
            proc.stdin.write(contract.order(env, nice))
            proc.stdin.close()
        except OSError as e:  # (it died between the poll and the write)
            logger.warning("the standby worker could not take its order (%s); starting the restart anew", e)
            _kill(proc)
            return None
        return proc

    def close(self) -> None:
        """End a waiting standby (it exits at the end of its input; SIGKILL makes sure)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass

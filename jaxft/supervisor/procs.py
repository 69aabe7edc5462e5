"""The launcher's dealings with OS processes: death with the parent, stopped processes,
fault-marker directories, and the local GPUs."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
from typing import Literal, overload


def _resolve_prctl():
    """libc's ``prctl``, looked up once in the launcher (never ``dlopen`` in a forked child,
    where a loader lock held by another thread of the parent could deadlock it)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _resolve_prctl()
_PR_SET_PDEATHSIG = 1


def _set_pdeathsig() -> None:
    """In the child, between fork and exec: die with SIGKILL when the launcher dies (Linux).
    Only a call through the pointer resolved above: no import, no allocation-heavy work."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


@overload
def _exited(proc: subprocess.Popen, block: Literal[True]) -> int: ...
@overload
def _exited(proc: subprocess.Popen, block: bool = False) -> int | None: ...
def _exited(proc: subprocess.Popen, block: bool = False) -> int | None:
    """``proc``'s exit status (Popen's convention: -N for signal N) once it has exited, else
    None; ``block``: wait for the exit. Where it can, it leaves ``proc`` unreaped (a zombie):
    its pid, and so the id of the process group it leads, cannot be reused before the
    launcher has killed that group and reaped it (:meth:`jaxft.supervisor.workers.WorkerPool.end_life`)."""
    if proc.returncode is not None or not hasattr(os, "waitid"):
        return proc.wait() if block else proc.poll()
    flags = os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG)
    try:
        info = os.waitid(os.P_PID, proc.pid, flags)
    except ChildProcessError:  # reaped already (Popen.poll elsewhere)
        return proc.wait() if block else proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


FAULT_DIR_PREFIX = "jaxft-faults-"


def _fault_dir() -> str:
    """A fresh directory for fault markers, named after this launcher's pid; those of
    launchers that died without cleaning up (SIGKILL) are removed first."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        if name.startswith(FAULT_DIR_PREFIX):
            pid = name[len(FAULT_DIR_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{FAULT_DIR_PREFIX}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def detect_gpus() -> list[int]:
    """Local NVIDIA GPU indices via ``nvidia-smi -L`` (empty when there are none)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [i for i, _ in enumerate(line for line in out.splitlines() if line.startswith("GPU "))]

"""The launcher's dealings with OS processes: death with the parent, stopped processes,
fault-marker directories, and the local GPUs."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import tempfile


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

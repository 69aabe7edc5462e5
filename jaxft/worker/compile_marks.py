"""Markers that say a process is compiling a shared step program (:mod:`jaxft.worker.executables`).

A process about to compile a program the others will load writes ``<program file>.compiling``
naming itself (``host pid``); the others wait for the program's file while the marker's owner
lives, instead of compiling the same program on the same cores. A compile killed with its
process leaves its marker behind, in a cache directory shared across runs
(``$JAXFT_COMPILATION_CACHE``) for later runs too: a marker counts only while its process is
alive and started before the marker was written (pids are reused).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

from jaxft.worker import lives


def claim(program_path: str) -> str | None:
    """Write the marker of ``program_path`` naming this process: its path, or None where another
    process's marker is there already (or the directory cannot be written)."""
    marker = program_path + ".compiling"
    try:
        os.makedirs(os.path.dirname(marker) or ".", exist_ok=True)
        with open(marker, "x") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}")
    except OSError:
        return None
    return marker


def owner(program_path: str) -> str | None:
    """The ``host pid`` of the marker of ``program_path``, None without one."""
    with contextlib.suppress(OSError), open(program_path + ".compiling") as f:
        return f.read()
    return None


def gone(owner: str, program_path: str) -> bool:
    """Whether the compile ``owner``'s marker of ``program_path`` names is known to be over: its
    process is gone, or its pid was reused after the marker was written."""
    try:
        written = os.stat(program_path + ".compiling").st_mtime
    except OSError:  # (removed meanwhile: the caller sees that next)
        return False
    return lives.local_process_gone(owner, since=written)


def wait_for(program_path: str, appear_s: float, wait_s: float) -> bool:
    """Wait for another process's compile of ``program_path`` to land; whether it did. False
    when no compile of it shows up (no marker) within ``appear_s``, its compiler is gone, the
    compile ended without a file (it failed, or could not be shared), or ``wait_s`` passed."""
    start = time.monotonic()
    seen = False
    while True:
        if os.path.exists(program_path):
            return True
        who = owner(program_path)
        seen = seen or who is not None
        waited = time.monotonic() - start
        if (not seen and waited > appear_s) or waited > wait_s or (who and gone(who, program_path)):
            return False
        if seen and who is None and not os.path.exists(program_path):
            return False
        time.sleep(0.01)

"""Sleep until a directory's entries change: inotify on Linux, a plain timeout elsewhere.

What lets :class:`jaxft.worker.deaths.Tripwire` stay armed without polling: a thread that looked at
the launcher's death records every 10 ms cost each process CPU in every step (on a machine
whose cores the processes share, every busy thread takes from the step's own program;
measured: docs/benchmarks.md, 'Figures behind the code'); one that sleeps in ``select``
until a record lands costs nothing while nobody dies, and wakes the moment one does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import select
import sys

logger = logging.getLogger(__name__)

# <sys/inotify.h>: an entry created, moved in or written (a record lands by os.replace).
_IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE = 0x8, 0x80, 0x100


def _inotify_fd(path: str) -> int | None:
    """A non-blocking inotify descriptor watching ``path``'s entries, or None (not Linux,
    no libc symbol, no directory, out of watches: the caller falls back to its timeout)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(fd, os.fsencode(path), _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"inotify_add_watch {path}")
        return fd
    except (OSError, AttributeError) as e:
        logger.debug("no inotify on %s (%s): falling back to timeouts", path, e)
        return None


def _drain(fd: int) -> bool:
    """Read everything pending on non-blocking ``fd``; True if there was anything."""
    got = False
    while True:
        try:
            if not os.read(fd, 4096):
                return got
            got = True
        except BlockingIOError:
            return got


class DirWatch:
    """``wait(timeout)`` returns when an entry of ``path`` is created or replaced, when
    :meth:`wake` is called, or after ``timeout``. ``native`` says whether changes wake it
    (inotify); without it only :meth:`wake` and the timeout do, and the caller polls."""

    def __init__(self, path: str):
        self.path = path
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:  # (then no inotify either: only the caller's timeout)
            logger.debug("cannot make %s: %s", path, e)
        self._fd = _inotify_fd(path)
        self._r, self._w = os.pipe()  # wake(): not inherited by children (PEP 446)
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    @property
    def native(self) -> bool:
        return self._fd is not None

    def wait(self, timeout: float) -> bool:
        """Sleep as above; True if the directory changed (always False without inotify)."""
        fds = [self._r] if self._fd is None else [self._fd, self._r]
        ready, _, _ = select.select(fds, [], [], timeout)
        if self._r in ready:
            _drain(self._r)
        return self._fd is not None and self._fd in ready and _drain(self._fd)

    def wake(self) -> None:
        """End the current (or the next) :meth:`wait` now; from any thread."""
        try:
            os.write(self._w, b"\0")
        except BlockingIOError:  # a wake-up is pending already
            pass

"""Orbax's log lines that report what jaxft does on purpose, demoted to DEBUG.

Orbax logs through absl (the ``absl`` Python logger) a warning on every save or rebuild of a
manager here, and a traceback from its background threads for a save jaxft abandoned because
a member died: both describe expected behaviour, and at WARNING they would read as failures.
"""

from __future__ import annotations

import logging

from jaxft.errors import SaveAbandoned

# Messages Orbax logs on every save or rebuild of a manager here, which describe expected behaviour.
_EXPECTED_MESSAGES = ("Given directory is read only", "No jax.Array in TypeHandlerRegistry")


def _abandoned(exc: BaseException | None) -> bool:
    """True when ``exc`` (or an exception it chains from) is jaxft's SaveAbandoned."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, SaveAbandoned):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class _ExpectedFilter(logging.Filter):
    """Demotes Orbax's expected warnings, and the tracebacks its background threads log for a
    save that jaxft abandoned on purpose (a member died), to DEBUG one-liners."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info is not None else None
        abandoned = _abandoned(exc)
        if abandoned or any(m in str(record.msg) for m in _EXPECTED_MESSAGES):
            if abandoned:
                record.msg = f"{record.getMessage()} (abandoned on purpose: {exc})"
                record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def install() -> None:
    """Add the filter to the ``absl`` logger (once per process)."""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _ExpectedFilter) for f in absl.filters):
        absl.addFilter(_ExpectedFilter())

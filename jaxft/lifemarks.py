"""Marks one worker life leaves for its launcher: empty files in the state dir they share.

``<state dir>/<kind>/<process>-<incarnation>``, written once by the worker (the launcher
hands it the directory, its process id and its incarnation in the environment) and read by
the launcher after the life ended: what the life reached (it connected: :mod:`jaxft.retire`;
it committed a step: :mod:`jaxft.crashloop`).
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

from jaxft import envvars

logger = logging.getLogger(__name__)


def path(state_dir: str, kind: str, process_id: int | str, incarnation: int | str) -> str:
    return os.path.join(state_dir, kind, f"{process_id}-{incarnation}")


def mark(kind: str, what: str, environ: Mapping[str, str] = os.environ) -> None:
    """Worker side: leave the mark ``kind`` for this life (``what`` names it in a warning if
    the file cannot be written); a no-op outside ``jaxft launch``."""
    state_dir, life, pid = (environ.get(envvars.FAULT_STATE_DIR), environ.get(envvars.INCARNATION),
                            environ.get(envvars.PROCESS_ID))
    if not state_dir or life is None or pid is None:
        return
    try:
        target = path(state_dir, kind, pid, life)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w"):
            pass
    except OSError as e:
        logger.warning("could not mark %s in %s: %s", what, state_dir, e)


def marked(state_dir: str, kind: str, process_id: int, incarnation: int) -> bool:
    """Launcher side: whether that life left the mark ``kind``."""
    return os.path.exists(path(state_dir, kind, process_id, incarnation))

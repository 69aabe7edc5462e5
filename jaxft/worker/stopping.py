"""A clean stop that can save a last checkpoint (``jaxft launch --checkpoint-on-stop``).

By default SIGTERM ends a worker at once (exit 143). With ``--checkpoint-on-stop`` the
signal only raises a flag; at the next commit the flagged members agree, through one
key-value entry, on a step at which every member stops: the first to propose writes
``committed step + MARGIN``, the others read it. At that commit the
:class:`~jaxft.ElasticCheckpointer` saves the state (and waits for the write), and the
loop exits 143. The margin covers a member whose signal handler runs one commit later
(a handler waits for the step it interrupted); a member that still misses it makes that
save abandon, and the previous checkpoint stays the latest.
"""

from __future__ import annotations

import logging
import os
import threading

from jaxft import protocol
from jaxft.worker import kv

logger = logging.getLogger(__name__)

STOP_KEY = "jaxft/stop_at"
MARGIN = 2

_requested = threading.Event()
_agreed: int | None = None


def wanted(environ=os.environ) -> bool:
    """Whether this worker was asked to checkpoint on stop (``jaxft launch --checkpoint-on-stop``)."""
    return environ.get(protocol.CHECKPOINT_ON_STOP) == "1"


def request() -> None:
    """Called by the SIGTERM handler: stop at an agreed step instead of at once."""
    _requested.set()


def requested() -> bool:
    """Whether this process was asked to stop (SIGTERM), whether or not a step is agreed yet."""
    return _requested.is_set()


def stop_step(committed: int) -> int | None:
    """The agreed step to stop at, once a stop was requested (None otherwise).

    ``committed`` is the number of steps this process has committed; the first member to
    ask proposes ``committed + MARGIN``.
    """
    global _agreed
    if _agreed is not None or not _requested.is_set():
        return _agreed
    agreed = kv.propose(STOP_KEY, str(committed + MARGIN))  # the first proposal wins
    if agreed is None:  # the service is gone: stop now
        logger.warning("cannot agree on a stop step; stopping now")
        _agreed = committed
    else:
        _agreed = int(agreed)
    logger.info("stopping after step %d (checkpoint on stop)", _agreed)
    return _agreed

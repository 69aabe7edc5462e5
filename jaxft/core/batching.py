"""How many steps one commit query covers when ``LoopOptions(commit_every="auto")`` (the default).

A commit query costs about the same whatever the step (one coordination-service round trip,
~0.5-1 ms on the project's machines), so it matters for short steps only; batching ``N`` steps
under one query divides that cost by ``N`` but a failure then undoes up to ``N - 1`` steps run
since the last commit, and the state that commit left stays alive (one more copy of it).
With a step of ``s`` seconds, a query of ``q`` seconds and failures at ``f`` per second, the
expected cost per step is ``q / N + f * s * (N - 1) * s / 2`` (a step fails with probability
``f * s`` and undoes ``(N - 1) / 2`` steps on average), smallest at ``N = sqrt(2 q / (f s^2))``.
:func:`commit_every` takes that ``N``, bounded so that batching happens only where the query
is a noticeable share of the step and a failure never undoes more than :data:`MAX_UNDO_S`.

Every member decides for itself and votes to commit when its own ``N`` is reached
(:func:`jaxft.core.step.own_votes`); the step's agreed votes commit a step as soon as any member
asks, so the members never need the same ``N``.
"""

from __future__ import annotations

import collections
import math
import statistics

WARMUP_STEPS = 16  # steps measured (each committed alone) before any batching
WINDOW = 64  # the recent steps (their mean period) and commit queries (their median) measured
MAX_STEPS = 16  # at most this many steps under one query
MAX_UNDO_S = 0.5  # at most this much training time undone by a failure
MIN_SHARE = 0.02  # batch only where one query costs at least this share of a step
PRIOR_FAILURE_S = 600.0  # before any failure, assume one every this many seconds
MAX_STATE_SHARE = 0.1  # batch only if the state is at most this share of a device's memory


def commit_every(step_s: float, query_s: float, failures_per_s: float) -> int:
    """The steps one commit query should cover (>= 1) for steps of ``step_s`` seconds, a query
    of ``query_s`` seconds and ``failures_per_s`` failures per second (see the module docstring)."""
    if step_s <= 0 or query_s < MIN_SHARE * step_s:
        return 1
    n = math.sqrt(2.0 * query_s / (max(failures_per_s, 1e-9) * step_s * step_s))
    return max(1, int(min(n, MAX_STEPS, MAX_UNDO_S / step_s)))


def memory_allows(state_bytes: int, device_bytes_limit: int | None) -> bool:
    """Whether one more copy of a state of ``state_bytes`` (per device) is cheap on a device of
    ``device_bytes_limit`` bytes (None: the device does not say, as on CPU: host memory)."""
    return device_bytes_limit is None or state_bytes <= MAX_STATE_SHARE * device_bytes_limit


class CommitBatcher:
    """One member's running estimate of :func:`commit_every`, fed with what it measures.

    Time is passed in (``now``, seconds on any monotonic clock), so a simulation can drive it.
    """

    def __init__(self, now: float, memory_ok: bool = True):
        self.memory_ok = memory_ok
        self._since = now  # failures are counted from here
        self._steps: collections.deque[float] = collections.deque(maxlen=WINDOW + 1)  # when each step ran
        self._queries: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.failures = 0
        self._outside = 0.0  # the time spent outside step attempts so far (see entered)
        self._left_at: float | None = None

    def entered(self, now: float) -> None:
        """The caller's loop starts a step attempt at ``now``. The time since :meth:`left` was
        the caller's own (an evaluation between steps, other programs: the overhead bench's
        plain loop), not a step's cost, and the step clock does not count it. What runs inside
        an attempt counts, ``on_commit`` hooks included."""
        if self._left_at is not None:
            self._outside += max(0.0, now - self._left_at)
            self._left_at = None

    def left(self, now: float) -> None:
        """The step attempt begun at :meth:`entered` returned at ``now``."""
        self._left_at = now

    def ran(self, now: float) -> None:
        """A step's program ended at ``now`` (committed or not): the mean time between two
        ends on the step clock (time inside step attempts) is the step's cost, its hooks and
        commits included."""
        self._steps.append(now - self._outside)

    def committed(self, query_s: float) -> None:
        """The steps run since the last commit committed; the commit query took ``query_s``."""
        self._queries.append(query_s)

    def failed(self) -> None:
        """A step failed: the pending steps are undone."""
        self.failures += 1

    def size(self, now: float) -> int:
        """The steps a commit should cover now (1 until :data:`WARMUP_STEPS` were measured)."""
        if not self.memory_ok or len(self._steps) <= WARMUP_STEPS or not self._queries:
            return 1
        rate = (self.failures + 1) / (now - self._since + PRIOR_FAILURE_S)
        step_s = (self._steps[-1] - self._steps[0]) / (len(self._steps) - 1)
        return commit_every(step_s, statistics.median(self._queries), rate)

    def commit_now(self, pending: int, now: float) -> bool:
        """Whether the step about to run, after ``pending`` steps run since the last commit,
        should commit (this member's vote): with it the batch is full."""
        return pending + 1 >= self.size(now)

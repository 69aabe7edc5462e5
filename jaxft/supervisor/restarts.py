"""When a worker exits, what the launcher does next: :class:`RestartPolicy` and its pure
:meth:`~RestartPolicy.decide`.

The rules, in the order they apply:

* a configuration error (:data:`~jaxft.protocol.EXIT_CONFIG_ERROR`) is never restarted, under
  any policy: a restart repeats it;
* a worker caught in a crash loop (:mod:`jaxft.supervisor.crashloop`) is not restarted on; under
  ``--restart all`` the job ends, as it restarts every worker or none;
* a failure (an exit status other than 0) is restarted by ``on-failure`` (this worker, while
  it has restarts left) and by ``all`` (every worker, while the job has rounds left);
* anything else (an exit 0, ``never``, a spent budget) ends this worker's part.

:meth:`RestartPolicy.decide` does no I/O and keeps no state: the launcher hands it what it
knows and carries the decision out.
"""

from __future__ import annotations

import dataclasses
import enum

from jaxft.errors import LaunchError
from jaxft.protocol import EXIT_CONFIG_ERROR
from jaxft.supervisor import crashloop

RESTART_POLICIES = ("never", "on-failure", "all")


class Action(enum.Enum):
    """What the launcher does with a worker that just exited."""

    RESTART = "restart"  # start this worker again (its own restart budget)
    RESTART_ALL = "restart-all"  # take every worker down and start them again (one round of the job's budget)
    STOP = "stop"  # stop restarting this worker; the others go on
    END_JOB = "end-job"  # end the whole job now, with exit code 1


class Reason(enum.Enum):
    """Why (:attr:`Decision.reason`)."""

    FINISHED = "finished"  # exit 0: the worker did its work
    FAILED = "failed"  # a failure, restarted
    CONFIG_ERROR = "configuration error"  # EXIT_CONFIG_ERROR: a restart repeats it
    CRASH_LOOP = "crash loop"  # crashed alike before a commit, life after life
    NEVER = "restart never"  # a failure, and the policy restarts none
    BUDGET_SPENT = "no restarts left"  # a failure past --max-restarts


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    reason: Reason


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """When and how dead workers come back (``jaxft launch --restart ...``).

    Attributes:
      mode: ``never``, ``on-failure`` (restart the worker that failed) or ``all`` (one
        failure restarts every worker that has not finished).
      max_restarts: restarts per process (``all``: rounds of the whole job).
      delay_s: wait this long before restarting a dead worker.
      max_setup_crashes: lives in a row crashing before a commit that stop the restarts
        (:mod:`jaxft.supervisor.crashloop`); 0: no limit.
      nice_restarts: a restarted worker sets up this much nicer, until it joins (:mod:`jaxft.priority`).
      early_connect: on one node, a restart connects once every member dropped its previous
        life (:func:`jaxft.protocol.restart_may_connect`) instead of after the heartbeat
        timeout + 1.5 s (default on; several nodes always wait, see docs/design.md).
      hung_after_s: a SIGSTOPped worker counts as dead after this (None: twice ``Timeouts.heartbeat``).
      standby: keep a standby interpreter per node, its imports done, that the next restart
        becomes (:mod:`jaxft.standby`; a Python command only; default on).
    """

    mode: str = "never"
    max_restarts: int = 10
    delay_s: float = 0.0
    max_setup_crashes: int = crashloop.DEFAULT_LIMIT
    nice_restarts: int = 0
    early_connect: bool = True
    hung_after_s: float | None = None
    standby: bool = True

    def validate(self) -> None:
        if self.mode not in RESTART_POLICIES:
            raise LaunchError(f"--restart must be one of {RESTART_POLICIES}, got {self.mode!r}")
        if self.delay_s < 0:
            raise LaunchError("--restart-delay must be >= 0")
        if self.max_restarts < 0:
            raise LaunchError("--max-restarts must be >= 0")
        if self.max_setup_crashes < 0:
            raise LaunchError("--max-setup-crashes must be >= 0 (0: no limit)")

    def decide(self, returncode: int, *, restarts: int, rounds: int, crash_loop: bool) -> Decision:
        """What to do with a worker that exited with ``returncode`` (Popen's convention: -N
        for signal N). ``restarts``: this worker's restarts so far (``on-failure``'s budget);
        ``rounds``: the most restarts of any worker of this node, the rounds of ``all`` so far;
        ``crash_loop``: the crash-loop guard tripped for this worker (its latest life counted)."""
        if returncode == EXIT_CONFIG_ERROR:
            return Decision(Action.STOP, Reason.CONFIG_ERROR)
        if self.mode != "never" and crash_loop:
            return Decision(Action.END_JOB if self.mode == "all" else Action.STOP, Reason.CRASH_LOOP)
        if returncode == 0:
            return Decision(Action.STOP, Reason.FINISHED)
        if self.mode == "never":
            return Decision(Action.STOP, Reason.NEVER)
        if (rounds if self.mode == "all" else restarts) >= self.max_restarts:
            return Decision(Action.STOP, Reason.BUDGET_SPENT)
        return Decision(Action.RESTART_ALL if self.mode == "all" else Action.RESTART, Reason.FAILED)

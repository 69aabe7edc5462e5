"""Deterministic fault injection: kill or hang a worker at a known step and phase.

A fault spec is ``ACTION:key=value:...``:

* ``kill:process=1:step=5`` -- worker 1 SIGKILLs itself when it reaches step 5 at the
  default phase (``after-grad``: gradients computed, nothing committed yet).
* ``kill:process=1:step=5:phase=before-step`` -- choose the phase; see :data:`PHASES`.
* ``kill-all:step=13`` -- the whole job dies at step 13: the first worker to reach it at
  that phase records it, every worker alive then dies (the step's members at the point
  itself, a restarted worker still setting up by its launcher), and workers started after
  it never fire it again (a cold restart that trains through step 13 once more does not
  die there twice). Per node: the record lives in that node's fault state directory.
* ``stop:process=2:step=7`` -- SIGSTOP: the worker stays alive but hangs.
* ``hang:process=2:step=7[:for=30s]`` -- the worker sleeps (alive, running, not stopped)
  at that point, for ``for`` seconds or until killed: a stuck read or a deadlock.
* phase ``in-step``: inside the atomic step, right before this process launches the step's
  program: a kill there leaves the other members waiting in the step's all-reduce.
* phases ``before-save`` (checkpoint ``step`` is due and this process has not begun it:
  a kill there leaves the others in the save's blocking barriers), ``during-save``
  (its async save has started) and ``before-publish`` (in the save's background phase: every
  member's writes are done, and the primary has yet to publish);
  ``during-rehydrate`` (the members agreed who is behind and who donates; the state
  has not moved yet: fires in the donor, the joiners and bystanders, with the step the
  process holds) and ``during-restore`` (a cold restore read the checkpoint, nothing
  adopted yet; ``step`` is the checkpoint's); ``admitted`` (a restarted process in the step
  that admits it, after the rebuild's barriers, before anything else: fires in the joiner,
  with the step it holds); ``restore-deferred`` (a restarted process put off its checkpoint
  restore because its peers train on, :meth:`jaxft.ElasticCheckpointer.restore`; ``step`` is
  the one it holds, 0 after a restart); ``ready`` (a joiner, a hot spare among them, right
  after it said it is ready, before it is admitted; ``step`` is the one it holds);
  ``in-commit`` (the step's commit query has been sent
  and the process waits in it: the rule fires from a timer 0.1 s after the query is handed
  to its thread, so that the query has reached the service); ``admitting`` (a member that
  has just admitted joiners, which enter at the next step; ``step=K`` fires at the first
  admission from step K on, whatever step that is); ``during-rebuild`` (inside a CPU
  data-plane rebuild, between its two barriers; ``step=K``: the first rebuild from step K on).
* ``kill:process=3:step=20:width=4`` -- ``width=N``: at the first step from 20 on whose
  members number N (at ``before-step``: the last committed step's, none right after a
  failed attempt): a story that waits for a rejoin, whatever this machine's speed.
* ``kill:process=0:after=4.5s`` -- launcher side: SIGKILL worker 0 4.5 s after launch.

Every rule fires once per run, also across restarts: a marker file per (rule, process)
in a state directory the launcher shares with its workers records that it fired.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

from jaxft import protocol
from jaxft.errors import FaultSpecError

ACTIONS = ("kill", "kill-all", "stop", "hang")
PHASES = ("before-step", "in-step", "after-grad", "after-commit", "before-save", "during-save", "during-rehydrate",
          "during-restore", "admitted", "restore-deferred", "in-commit", "admitting", "during-rebuild", "ready",
          "before-publish")
FROM_STEP_PHASES = ("admitting", "during-rebuild")  # step=K: "at the first such point from step K on"
IN_COMMIT_DELAY_S = 0.1  # an in-commit rule fires this long after the query is handed to its thread
DEFAULT_PHASE = "after-grad"


@dataclasses.dataclass(frozen=True)
class FaultRule:
    """One fault: ``action`` on ``process`` at ``step``/``phase`` or ``after`` seconds."""

    action: str
    process: int | None = None
    step: int | None = None
    phase: str = DEFAULT_PHASE
    after: float | None = None
    duration: float | None = None  # hang: seconds to sleep (None: until killed)
    width: int | None = None  # fire from ``step`` on, at the first step with this many members
    index: int = 0  # position in the rule list; part of the rule's identity

    @property
    def launcher_side(self) -> bool:
        return self.after is not None

    @property
    def spec(self) -> str:
        parts = [self.action]
        if self.process is not None:
            parts.append(f"process={self.process}")
        if self.step is not None:
            parts += [f"step={self.step}", f"phase={self.phase}"]
        if self.after is not None:
            parts.append(f"after={self.after:g}s")
        if self.duration is not None:
            parts.append(f"for={self.duration:g}s")
        if self.width is not None:
            parts.append(f"width={self.width}")
        return ":".join(parts)

    def marker(self, process: int) -> str:
        return f"rule{self.index}-p{process}-{self._file_spec}"

    def fired_marker(self) -> str:
        """The run-wide record of a ``kill-all``: it holds when the rule first fired (``time.time()``)."""
        return f"rule{self.index}-fired-{self._file_spec}"

    @property
    def _file_spec(self) -> str:
        return self.spec.replace(":", "_").replace("=", "-")


def parse_rule(text: str, index: int = 0) -> FaultRule:
    """Parse one spec such as ``kill:process=1:step=5:phase=after-grad``."""
    action, *pairs = text.strip().split(":")
    if action not in ACTIONS:
        raise FaultSpecError(f"fault {text!r}: unknown action {action!r}; expected one of {ACTIONS}")
    fields: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not value:
            raise FaultSpecError(f"fault {text!r}: expected key=value, got {pair!r}")
        try:
            if key == "process":
                fields["process"] = int(value)
            elif key == "step":
                fields["step"] = int(value)
            elif key == "phase":
                if value not in PHASES:
                    raise FaultSpecError(f"fault {text!r}: unknown phase {value!r}; expected one of {PHASES}")
                fields["phase"] = value
            elif key == "after":
                fields["after"] = float(value.removesuffix("s"))
            elif key == "for":
                fields["duration"] = float(value.removesuffix("s"))
            elif key == "width":
                fields["width"] = int(value)
            else:
                raise FaultSpecError(f"fault {text!r}: unknown key {key!r} (process, step, phase, after, for, width)")
        except ValueError as e:
            if isinstance(e, FaultSpecError):
                raise
            raise FaultSpecError(f"fault {text!r}: bad value for {key}: {value!r}") from None
    rule = FaultRule(action=action, index=index, **fields)
    if (rule.step is None) == (rule.after is None):
        raise FaultSpecError(f"fault {text!r}: give exactly one trigger, step=K or after=Ts")
    if rule.step is not None and rule.step < 0 or rule.after is not None and rule.after < 0:
        raise FaultSpecError(f"fault {text!r}: triggers must be non-negative")
    if action == "kill-all":
        if rule.process is not None:
            raise FaultSpecError(f"fault {text!r}: kill-all takes no process")
    elif rule.process is None:
        raise FaultSpecError(f"fault {text!r}: {action} needs process=N")
    if rule.launcher_side and action in ("kill-all", "hang"):
        raise FaultSpecError(f"fault {text!r}: {action} is step-triggered only")
    if rule.width is not None and (rule.step is None or rule.width < 1):
        raise FaultSpecError(f"fault {text!r}: width= takes a positive member count, and only with step=K")
    if rule.duration is not None and (action != "hang" or rule.duration < 0):
        raise FaultSpecError(f"fault {text!r}: for= takes a non-negative duration, and only with hang")
    return rule


def parse_rules(specs: Sequence[str] | str | None) -> list[FaultRule]:
    """Parse a list of specs, or one ``;``-joined string (the launcher's env form)."""
    if specs is None:
        return []
    if isinstance(specs, str):
        specs = [s for s in specs.split(";") if s.strip()]
    return [parse_rule(s, i) for i, s in enumerate(specs)]


def _create_once(state_dir: str, name: str, content: str = "") -> bool:
    """Atomically create the marker file ``name`` holding ``content``; False if it exists
    already. (With content: written to a private file first, then linked in, so a reader
    never sees the marker empty.)"""
    path = os.path.join(state_dir, name)
    if not content:
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        f.write(content)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


def claim(state_dir: str | None, rule: FaultRule, process: int) -> bool:
    """Atomically mark ``rule`` as fired for ``process``; False if it already fired."""
    if state_dir is None:
        return True
    os.makedirs(state_dir, exist_ok=True)
    return _create_once(state_dir, rule.marker(process))


def fired_at(state_dir: str | None, rule: FaultRule) -> float | None:
    """When ``rule`` (a ``kill-all``) first fired in any worker sharing ``state_dir``; None: not yet."""
    if state_dir is None:
        return None
    path = os.path.join(state_dir, rule.fired_marker())
    try:
        with open(path) as f:
            # the time the firing life wrote: a file's mtime comes from the kernel's coarse clock,
            # up to a few ms behind time.time(), so a life born just before the fire could read an
            # mtime before its birth and take the fire for an earlier run's (a flaky test showed it)
            return float(f.read())
    except FileNotFoundError:
        return None
    except ValueError:  # a record written by older code (empty): its mtime
        return os.stat(path).st_mtime


def _hang(duration: float | None) -> None:
    deadline = None if duration is None else time.monotonic() + duration
    while deadline is None or time.monotonic() < deadline:
        time.sleep(0.5 if deadline is None else min(0.5, max(0.0, deadline - time.monotonic())))


class FaultInjector:
    """The worker-side half: call :meth:`point` at each phase of each step."""

    def __init__(self, rules: Sequence[FaultRule], process_id: int, state_dir: str | None = None,
                 on_fire: Callable[[FaultRule, int], None] | None = None):
        self.rules = [r for r in rules if not r.launcher_side and r.process in (None, process_id)]
        self.process_id = process_id
        self.state_dir = state_dir
        self.on_fire = on_fire
        self.born = time.time()  # a kill-all that fired before this life began is not its fault
        self.width: int | None = None  # members of the step this process is in (or last committed)

    def at_width(self, width: int | None) -> None:
        """Record the members of the step just entered (None: the attempt failed; the retry's
        ``before-step`` must not count the width it had), for ``width=N`` rules."""
        self.width = width

    @classmethod
    def from_env(cls, process_id: int, on_fire: Callable[[FaultRule, int], None] | None = None,
                 environ=os.environ) -> FaultInjector:
        return cls(parse_rules(environ.get(protocol.FAULTS)), process_id,
                   environ.get(protocol.FAULT_STATE_DIR), on_fire)

    def quiet_at(self, step: int) -> bool:
        """Whether no rule of this process can fire at ``step`` (at any phase): a step that
        jaxft runs differently (started early, :class:`jaxft.ElasticLoop`'s ``pipeline``)
        then keeps every fault point where the rules expect it."""
        for rule in self.rules:
            if rule.step is None or (step != rule.step if rule.width is None and rule.phase not in FROM_STEP_PHASES
                                     else step < rule.step):
                continue
            if self.state_dir is None or not os.path.exists(os.path.join(self.state_dir, rule.marker(self.process_id))):
                return False  # (a rule that fired in this process never fires again)
        return True

    def _matches(self, rule: FaultRule, step: int) -> bool:
        if rule.step is None:  # a launcher-side rule (after=), never a step's
            return False
        if rule.width is not None:
            return step >= rule.step and self.width == rule.width
        return step >= rule.step if rule.phase in FROM_STEP_PHASES else step == rule.step

    def point_soon(self, phase: str, step: int, delay_s: float = IN_COMMIT_DELAY_S) -> None:
        """:meth:`point` from a timer thread ``delay_s`` from now, if a rule may fire there (for
        a phase where the process waits in a call, such as ``in-commit``)."""
        if any(r.phase == phase and self._matches(r, step) for r in self.rules):
            timer = threading.Timer(delay_s, self.point, (phase, step))
            timer.daemon = True
            timer.start()

    def point(self, phase: str, step: int) -> None:
        """Fire every rule that matches ``(phase, step)`` and has not fired yet."""
        if phase not in PHASES:
            raise ValueError(f"unknown fault phase {phase!r}; expected one of {PHASES}")
        for rule in self.rules:
            if rule.phase != phase or not self._matches(rule, step):
                continue
            if rule.action == "kill-all" and (t := fired_at(self.state_dir, rule)) is not None and t < self.born:
                continue  # the job died there before this process started: once per run
            if claim(self.state_dir, rule, self.process_id):
                if rule.action == "kill-all" and self.state_dir is not None:
                    # False: another member recorded it
                    _create_once(self.state_dir, rule.fired_marker(), repr(time.time()))
                if self.on_fire is not None:
                    self.on_fire(rule, step)
                sys.stdout.flush()
                sys.stderr.flush()
                if rule.action == "hang":  # alive but stuck: a slow filesystem, a deadlock, a stuck read
                    _hang(rule.duration)
                    continue
                sig = signal.SIGSTOP if rule.action == "stop" else signal.SIGKILL
                os.kill(os.getpid(), sig)

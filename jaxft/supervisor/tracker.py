"""What a run's events say, folded into progress figures and incident stories (:class:`RunTracker`,
no I/O); the console (:mod:`jaxft.supervisor.console`) shows them."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from jaxft.protocol import Event

# How a process that left the step is told when this agent saw no exit of it (another node's).
LEFT = "left the step; another node's process"


def _fmt_time(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds < 0:
        return "-:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _procs(ps: Iterable[int]) -> str:
    ps = sorted(ps)
    return f"process {ps[0]}" if len(ps) == 1 else "processes " + ", ".join(map(str, ps))


def _later(factory=None, default=None):
    """A field that is filled in later, not a parameter of the constructor."""
    if factory is not None:
        return dataclasses.field(init=False, default_factory=factory)
    return dataclasses.field(init=False, default=default)


@dataclasses.dataclass
class Incident:
    """One burst of failures and how the run got over it: when it began and at which step;
    the rest is filled in as its events come (:class:`RunTracker`)."""

    start: float
    step: int  # the step being computed when it began
    deaths: dict[int, str] = _later(dict)  # process -> how it died
    death_steps: dict[int, int] = _later(dict)
    exited: set[int] = _later(set)
    pending: set[int] = _later(set)  # restarted, not training yet
    back: set[int] = _later(set)  # restarted and training again
    retried: tuple[int, int, float] | None = _later(default=None)  # (members, step, seconds)
    failed_steps: set[int] = _later(set)
    rejoins: list[str] = _later(list)
    restored: dict[int, tuple[int, float]] = _later(dict)  # process -> (step, s)
    restart_all: bool = _later(default=False)
    gave_up: dict[int, int] = _later(dict)  # process -> crashes alike (not restarted)
    resumed_at: float | None = _later(default=None)  # first commit of a new step after a cold restart
    nodes: list[str] = _later(list)  # what jaxft slurm did: a node lost, a new agent started

    def story(self, ended: bool = False) -> str:
        """One line: who died, how the run got over it; ``ended``: the run finished while this
        incident was open (a restarted process still setting up then is not a lost one)."""
        causes = collections.defaultdict(list)
        for p, how in self.deaths.items():
            causes[(self.death_steps.get(p, self.step), how)].append(p)
        parts = [f"{_procs(ps)} {'died' if 'code' not in how else 'failed'} at step {step} ({how})"
                 for (step, how), ps in sorted(causes.items())]
        parts.extend(self.nodes)
        if self.retried:
            n, step, secs = self.retried
            parts.append(f"{n} member{'s' if n != 1 else ''} retried step {step} in {secs:.1f} s")
        if self.restart_all:
            parts.append("all processes restarted (--restart all)")
        down = set(self.deaths) - self.back - set(self.gave_up)
        late = down & self.pending if ended else set()  # restarted; the run ended before they rejoined
        restored = {p: r for p, r in self.restored.items() if p not in late}
        if restored:
            step, secs = next(iter(restored.values()))
            parts.append(f"{_procs(restored)} restored checkpoint step {step} "
                         f"in {max(s for _, s in restored.values()):.1f} s")
        if self.resumed_at is not None and not self.retried:
            parts.append(f"training resumed after {self.resumed_at - self.start:.1f} s")
        parts.extend(self.rejoins)
        if late:
            parts.append(f"{_procs(late)} restarted; the run ended before {'it' if len(late) == 1 else 'they'} "
                         "could rejoin")
        if self.gave_up:
            parts.append(f"{_procs(self.gave_up)} crashed {max(self.gave_up.values())} times in a row before "
                         "a commit: not restarted")
        if down - late and not self.restart_all:
            parts.append(f"{_procs(down - late)} did not come back")
        return "; ".join(parts)


class RunTracker:
    """Folds a run's events into progress figures and incident stories (no I/O)."""

    def __init__(self, num_processes: int | None = None):
        self.num_processes = num_processes
        self.total: int | None = None
        self.start: float | None = None
        self.step = 0  # steps committed (the next step to compute)
        self.width = 0
        self.commit_times: collections.deque = collections.deque(maxlen=50)  # (time, step)
        self.incidents_seen = 0
        self.open: Incident | None = None
        self.finals: dict[int, str] = {}
        self.stories: list[str] = []  # closed incidents, in order
        self._fault_steps: dict[int, int] = {}
        self._committed: set[int] = set()
        self._members: set[int] = set()  # the latest step's

    # -- events ---------------------------------------------------------------------------
    def feed(self, e: dict) -> list[str]:
        """Take one event; returns the stories of incidents it closed."""
        kind, t, p = e.get("event"), e.get("time", 0.0), e.get("process")
        if kind in (Event.RUN_START, Event.LAUNCH) and self.start is None:
            self.start = t
        if kind == Event.TRAIN_START and e.get("total_steps"):
            self.total = int(e["total_steps"])
        elif kind == Event.FAULT and isinstance(p, int):
            if e.get("step") is not None:
                self._fault_steps[p] = int(e["step"])
            inc = self._incident(t)
            inc.deaths.setdefault(p, "SIGKILL" if e.get("action") != "stop" else "SIGSTOP")
            inc.death_steps.setdefault(p, self._fault_steps.get(p, self.step))
        elif kind == Event.EXIT and isinstance(p, int):
            self._exit(e, t, p)
        elif kind == Event.RESTART and self.open is not None and isinstance(p, int):
            self.open.pending.add(p)
        elif kind == Event.CRASH_LOOP and isinstance(p, int):
            inc = self._incident(t)
            inc.pending.discard(p)
            inc.gave_up[p] = int(e.get("crashes", 0))
        elif kind == Event.STEP_FAILED and self.open is not None:
            self.open.failed_steps.add(int(e["step"]))
        elif kind == Event.REHYDRATED and self.open is not None:
            if p is not None:
                self.open.restored.pop(p, None)  # a joiner's start-up restore, superseded by a live peer's state
            self.open.rejoins.append(f"process {p} rejoined at step {e.get('step')}, rehydrated from "
                                     f"process {e.get('donor')} in {float(e.get('seconds', 0)):.1f} s")
        elif kind == Event.RESTORED and self.open is not None and isinstance(p, int):
            self.open.restored[p] = (int(e.get("step", 0)), float(e.get("seconds", 0.0)))
        elif kind == Event.NODE_LOST:
            inc = self._incident(t)
            for q in e.get("processes") or []:
                self._lost(inc, int(q), f"node {e.get('node')} lost", self.step)
            inc.nodes.append(f"node {e.get('node')} (rank {e.get('rank')}) lost: {e.get('reason')}")
        elif kind == Event.NODE_STARTED and e.get("generation"):
            where = {"spare": "a spare", "returned": "back after its loss"}.get(str(e.get("why")), str(e.get("why")))
            self._incident(t).nodes.append(f"rank {e.get('rank')}: new agent on {e.get('node')} ({where})")
        elif kind == Event.COMMIT:
            return self._commit(e, t, p)
        elif kind == Event.FINAL and isinstance(p, int):
            self.finals[p] = str(e.get("params_sha256", ""))
        return []

    def _incident(self, t: float) -> Incident:
        if self.open is None:
            self.open = Incident(start=t, step=self.step)
            self.incidents_seen += 1
        return self.open

    def _lost(self, inc: Incident, p: int, how: str, step: int) -> None:
        """``p`` is gone with no exit this agent saw (another node's process); back when it commits."""
        if inc.deaths.get(p, LEFT) == LEFT:
            inc.deaths[p] = how
        inc.death_steps.setdefault(p, step)
        inc.exited.add(p)
        if p not in inc.back:
            inc.pending.add(p)

    def _exit(self, e: dict, t: float, p: int) -> None:
        reason = e.get("reason")
        if reason == "terminated by launcher":
            return
        if reason == "killed by --restart all":
            if self.open is not None:
                self.open.restart_all = True
            return
        sig, code = e.get("signal"), e.get("code")
        if sig is None and code == 0:
            return
        inc = self._incident(t)
        how = (f"hung, {reason}" if reason and "hung" in reason else sig) if sig else f"exit code {code}"
        if p not in inc.deaths or inc.deaths[p] == LEFT or sig is None or (reason and "hung" in reason):
            inc.deaths[p] = how
        inc.death_steps.setdefault(p, self._fault_steps.get(p, self.step))
        inc.exited.add(p)

    def _commit(self, e: dict, t: float, p) -> list[str]:
        step = int(e["step"])
        members = e.get("members") or []
        new = step not in self._committed
        if new:
            self._committed.add(step)
            self.step = max(self.step, step + 1)
            self.width = len(members)
            self.commit_times.append((t, step))
            left = self._members - set(members) if step == self.step - 1 else set()
            if left:  # processes gone from the step: exits this agent saw, or another node's
                opened = self._incident(t)
                for q in sorted(left):
                    if q not in opened.deaths:
                        self._lost(opened, q, LEFT, step)
            self._members = set(members)
        inc = self.open
        if inc is None:
            return []
        if step in inc.failed_steps and inc.retried is None and new:
            inc.retried = (len(members), step, t - inc.start)
        if isinstance(p, int) and p in inc.pending:
            inc.pending.discard(p)
            inc.back.add(p)
        if inc.resumed_at is None and (inc.restored or inc.restart_all) and not inc.pending:
            inc.resumed_at = t
        if not inc.pending and inc.exited >= set(inc.deaths) and (inc.retried or not inc.failed_steps
                                                                    or inc.resumed_at):
            return [self._close()]
        return []

    def _close(self, ended: bool = False) -> str:
        assert self.open is not None, "no incident is open"
        story = self.open.story(ended)
        self.stories.append(story)
        self.open = None
        return story

    def finish(self) -> list[str]:
        """At the end of the run: the story of an incident still open."""
        if self.open is None:
            return []
        return [self._close(ended=True)]

    # -- figures --------------------------------------------------------------------------
    def rate(self) -> float | None:
        """Steps per second over the recent commits."""
        if len(self.commit_times) < 2:
            return None
        (t0, s0), (t1, s1) = self.commit_times[0], self.commit_times[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None

    def line(self, now: float) -> str:
        elapsed = now - self.start if self.start else 0.0
        rate = self.rate()
        total = self.total
        eta = (total - self.step) / rate if rate and total else None
        return (f"step {self.step}/{total or '?'} | {f'{rate:.2f}' if rate else '-'} steps/s | "
                f"width {self.width} | incidents {self.incidents_seen} | "
                f"elapsed {_fmt_time(elapsed)} | ETA {_fmt_time(eta)}")

"""A deterministic simulation of the step protocol: N processes, a model of the coordination
service, kills, late members, restarts, and a seeded scheduler that picks the interleaving.

Each simulated process runs the protocol's decisions from :mod:`jaxft.core` (the same code the
worker runs): :class:`~jaxft.core.commit.MemberStep` for entry and exit, the liveness rules of
:mod:`~jaxft.core.liveness` (asking again on a death record, confirming an answer that names a
changed life), and the step votes of :mod:`~jaxft.core.votes` (a program whose members ran
different steps fails everywhere, and the next one brings those behind forward). What the
worker does with I/O is modelled here as events the scheduler delivers in any order it likes:

* the service's liveness queries, matched by process set (``tests/service_model.py``), and its
  heartbeat, which may declare a dead process dead at any time after its death;
* the launcher, which sees a kill at once, retires the dead life in the service (a new
  incarnation, ``retire``) and then records the death for the members;
* a step's program (its collectives), which completes when every member of its set entered the
  same program, fails for the others when a member of it is recorded dead, and fails on its
  collective timeout only when nothing else can move (a bounded wait);
* restarts: a dead process comes back (once the service declared its previous life dead, or,
  a kill its launcher saw, once every member alive at the death dropped that life: the early
  connect), says it is ready, and is admitted by the members' votes.

Invariants, checked on every schedule:

1. **agreement**: every commit of step k, by any life, has the same member set and the same
   resulting state;
2. **no mixing**: no member commits a state computed from members at different steps or states;
3. **no step lost or applied twice**: each life commits consecutive steps (a rehydration moves
   it to the donor's step first), and every surviving member ends at the target with the same
   state;
4. **bounded**: every schedule ends (all live processes reach the target) within its budget,
   with no wait left that nothing can end.

``Options(retire=False, confirm=False, votes=False)`` is the protocol before the correctness
issue: the simulation finds its split commits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Generator
from typing import Any

from service_model import ServiceModel

from jaxft.core import commit, liveness, rejoin


@dataclasses.dataclass(frozen=True)
class Options:
    retire: bool = True  # the launcher gives a dead process a new incarnation before it records the death
    confirm: bool = True  # an answer naming a changed life is confirmed by one more query
    votes: bool = True  # a step's program carries each member's step: mixed steps fail everywhere
    # a restart connects once every member alive at the death dropped the dead life (a final
    # answer without it), not only once the service declared it dead (jaxft launch --early-connect)
    early_connect: bool = True
    # a member waiting in a query re-asks without a process whose registered life is newer than
    # the one it expects (a restart that connected after the service declared the old one dead)
    restarted: bool = True


class Violation(AssertionError):
    """An invariant broke in a schedule (the message says which, and the seed replays it)."""


def _h(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


INITIAL = _h("init")


def advance(state: str, step: int) -> str:
    """The state after step ``step`` from ``state`` (a hash chain: equal inputs, equal outputs)."""
    return _h(state, step)


# -- requests a process yields to the scheduler ---------------------------------------------------

@dataclasses.dataclass
class Query:
    pids: tuple[int, ...]
    answer: dict[int, int] | None = None
    answered_at: int = -1


@dataclasses.dataclass
class Program:
    key: tuple[Any, ...]  # (member set, kind): kind "sync" when the members bring someone forward
    contribution: tuple[int, str]  # (step, state)
    result: dict[int, tuple[int, str]] | None = None  # every member's contribution, once complete
    failed: bool = False


class _Proc:
    """One simulated process: one life at a time."""

    def __init__(self, sim: Simulation, pid: int):
        self.sim, self.pid = sim, pid
        self.life = 0  # the launcher's incarnation of it
        self.registered = 1000 + pid  # the service incarnation its current life registered (lives.register)
        self.alive = True
        self.gen: Generator | None = None
        self.waiting: Any = None  # the request it waits on
        self.step, self.state = 0, INITIAL
        self.done = False
        self.left: dict[tuple[int, ...], Query] = {}  # queries this life left, by set (still counted in)
        self.seen: dict[int, set[int]] = {}  # every life this life saw, per process

    def start(self, joiner: bool) -> None:
        self.known_at_start = dict(self.sim.service.incarnation)  # the lives it may hear recorded dead
        self.alive, self.done = True, False
        self.left, self.seen = {}, {}
        self.step, self.state = 0, INITIAL
        self.gen = self.sim.member(self, joiner)
        try:
            self.waiting = next(self.gen)
        except StopIteration:  # (the run ended before it could join)
            self.waiting, self.done = None, True


class Simulation:
    """One schedule: ``seed`` picks every choice; :meth:`run` raises :class:`Violation`."""

    def __init__(self, seed: int, n: int = 3, target: int = 4, kills: int = 2, options: Options = Options(),
                 budget: int = 4000):
        self.rng = random.Random(seed)
        self.seed, self.n, self.target, self.options, self.budget = seed, n, target, options, budget
        self.kills_left = kills
        self.service = ServiceModel(n)
        self.procs = [_Proc(self, p) for p in range(n)]
        self.records: set[tuple[int, int]] = set()  # (process, service incarnation) the launcher recorded dead
        self.pending_launcher: list[tuple[str, int, int]] = []  # ("retire"|"record"|"restart", pid, incarnation)
        self.programs: dict[tuple[Any, ...], dict[int, Program]] = {}
        self.ready: set[int] = set()  # joiners that said they are ready
        # joiner -> (the processes of the step it enters, the admitting members' lives)
        self.admissions: dict[int, tuple[tuple[int, ...], dict[int, int]]] = {}
        self.checkpoint = (0, INITIAL)  # the newest committed (step, state): a checkpoint every step
        self.published = False  # a member entered a step: a restart finds the member list and asks to join
        self.dropped: set[tuple[int, int, int]] = set()  # (process, life, member that dropped that life)
        self.witnesses: dict[int, tuple[int, dict[int, int]]] = {}  # killed -> (its life, {other: its life})
        self.admitted: dict[int, dict[int, int]] = {}  # member -> the joiners it last admitted, with their lives
        self.clock = 0  # events so far
        self.watchdog_exits = 0  # waits that only a bound ended (Timeouts.barrier, admission)
        self.speed = [self.rng.choice([0.05, 1.0, 1.0]) for _ in range(n)]  # a late member is slow to move
        self.desyncs = 0  # programs whose members ran different steps (failed everywhere on the votes)
        self.commits: dict[int, set[tuple[tuple[int, ...], str]]] = {}  # step -> {(members, state after)}
        self.log: list[str] = []

    # -- the members -----------------------------------------------------------------------
    def member(self, proc: _Proc, joiner: bool) -> Generator:
        """One life of a process: the step protocol until the target (a generator of requests)."""
        ms = commit.MemberStep()
        resync = False
        first = True
        last_entry: dict[int, int] = {}
        admitted_by: dict[int, int] = {}
        restore_put_off = joiner  # a restart puts off its checkpoint restore while members train on
        while proc.step < self.target:
            plan = ms.plan_entry()
            if isinstance(plan, commit.UseCommitted):
                entry = dict(plan.entry)
            elif first and joiner:
                self.ready.add(proc.pid)
                while proc.pid not in self.admissions:
                    if self._members_gone():
                        proc.left_run = True  # the run ended before it could join: it exits 0
                        return
                    yield "admission"
                pids, admitted_by = self.admissions.pop(proc.pid)  # the members and every joiner admitted with it
                self.ready.discard(proc.pid)
                ms.joining = True
                entry = yield from self.live_nodes(proc, pids, known={})
            elif first:  # a cold start: every process forms the first member set
                entry = yield from self.live_nodes(proc, tuple(range(self.n)), known=proc.known_at_start)
            else:
                # (a joiner's death after its admission counts too: DeathWatch.assume_alive_since)
                admitted = {j: life for j, life in self.admitted.get(proc.pid, {}).items() if j in plan.expect}
                entry = yield from self.live_nodes(proc, plan.pids, known={**last_entry, **admitted},
                                                   expect=plan.expect,
                                                   lives=dict(plan.lives) if self.options.confirm else None)
            first = False
            if ms.joining and restore_put_off and not any(entry.get(p) == life for p, life in admitted_by.items()):
                # left without the members that admitted it (they all died): its put-off restore runs now
                restore_put_off = False
                proc.step, proc.state = self.checkpoint
            last_entry = dict(entry)
            ms.entered(entry)
            self.published = True  # (the members tell restarts who runs: they come back as joiners)
            gained = rejoin.is_new(ms.agreed, entry)
            sync = gained or resync
            ticket = Program((tuple(sorted(entry)), "sync" if sync else "step"), (proc.step, proc.state))
            ticket.entry = dict(entry)  # type: ignore[attr-defined]
            yield ticket
            body_ok, desync, new = not ticket.failed, False, None
            if body_ok:
                contributions = ticket.result
                if sync:  # every member brings itself to the donor's step and state, then steps
                    donor = rejoin.donor({p: s for p, (s, _) in contributions.items()})
                    proc.step, proc.state = contributions[donor]
                elif len(set(contributions.values())) > 1:  # the members ran different steps or states
                    if self.options.votes:
                        desync = True
                    else:  # nothing tells them: each goes on from a mix (a silent wrong result)
                        new = "MIXED:" + _h(sorted(contributions.items()))
                new = new or advance(proc.state, proc.step)
            exit_answer = yield from self.live_nodes(proc, tuple(sorted(entry)), known=entry,
                                                     lives=entry if self.options.confirm else None)
            outcome = ms.exited(entry, exit_answer, body_ok and not desync)
            if outcome is commit.Outcome.COMMIT:
                self._commit(proc, entry, new)
                resync = False
                # the votes: the ready joiners the program's members saw, the same for all of them
                joiners = sorted(ticket.ready - set(entry))  # type: ignore[attr-defined]
                if joiners and proc.step < self.target:  # (nobody is admitted after the last step)
                    ms.admit(joiners)
                    self.admitted[proc.pid] = {j: self.procs[j].registered for j in joiners}
                    for j in joiners:
                        self.admissions[j] = (tuple(sorted(set(exit_answer) | set(joiners))), dict(entry))
            elif desync:
                resync = True  # (every member of the program saw it)
                self.desyncs += 1
            elif outcome is commit.Outcome.ERROR:  # its own body failed, nobody else: it raises, and dies
                proc.crashed = True
                return
        proc.done = True

    def live_nodes(self, proc: _Proc, pids: tuple[int, ...], known: dict[int, int],
                   lives: dict[int, int] | None = None, expect: frozenset[int] = frozenset()) -> Generator:
        """A liveness query with the worker's rules (:class:`jaxft.worker.deaths.DeathWatch`): ask
        again without a process recorded dead while waiting (``known``: the lives this member
        knows), wait on a query over the same set it left earlier where the rule says so, and
        confirm an answer that is smaller, or names a changed life (``lives``)."""
        asked = tuple(sorted(pids))
        while True:
            q = self._reuse(proc, asked, expect) or self._ask(proc, asked)
            while q.answer is None:
                proc.known = known  # (the lives it would hear recorded dead while it waits)
                yield q  # resumed with an answer, or to look at the death records
                if q.answer is None:
                    again = liveness.on_deaths(asked, self._recorded(asked, known))
                    if again is not None:  # (the query left stays open in the service, this process in it)
                        proc.left[asked] = q
                        asked = again.pids
                        q = self._reuse(proc, asked, expect) or self._ask(proc, asked)
            move = liveness.on_answer(asked, q.answer, lives)
            if isinstance(move, liveness.Done):
                for p, life in (lives or {}).items():  # (protocol.mark_dropped)
                    if move.answer.get(p) != life:
                        self.dropped.add((p, life, proc.pid))
                for p, life in move.answer.items():
                    proc.seen.setdefault(p, set()).add(life)
                return dict(move.answer)
            asked = move.pids

    def _reuse(self, proc: _Proc, asked: tuple[int, ...], expect: frozenset[int]) -> Query | None:
        left = proc.left.pop(asked, None)
        if left is None:
            return None
        lives = self.admitted.get(proc.pid, {})
        if liveness.reuse_left_query(left.answer is not None, left.answer, {j: lives.get(j, -1) for j in expect}):
            return left
        return None

    def _ask(self, proc: _Proc, pids: tuple[int, ...]) -> Query:
        q = Query(pids)
        life = proc.life

        def done(answer: dict[int, int]) -> None:
            if proc.life == life:  # (a dead life's query completes for nobody)
                q.answer = answer
                q.answered_at = self.clock

        self.service.submit(proc.pid, pids, done, label=(proc.pid, life))
        return q

    def _recorded(self, pids: tuple[int, ...], known: dict[int, int]) -> list[int]:
        """The processes of ``pids`` whose known life is over: recorded dead by its launcher, or
        replaced by a newer registered life (a restart: :func:`jaxft.worker.lives.over`)."""
        return [p for p in pids if (p, known.get(p, -1)) in self.records
                or (self.options.restarted and p in known and self.procs[p].alive
                    and self.procs[p].registered != known[p])]

    def _commit(self, proc: _Proc, entry: dict[int, int], new: str) -> None:
        step = proc.step
        if new.startswith("MIXED:"):
            raise Violation(f"no mixing: process {proc.pid} committed step {step} from members at different steps")
        self.commits.setdefault(step, set()).add((tuple(sorted(entry)), new))
        if len(self.commits[step]) > 1:
            raise Violation(f"agreement: step {step} committed two ways: {sorted(self.commits[step])}")
        proc.step, proc.state = step + 1, new
        self.checkpoint = max(self.checkpoint, (step + 1, new))

    def _members_gone(self) -> bool:
        return not any(p.alive and not p.done and p.pid not in self.ready for p in self.procs)

    # -- the scheduler ------------------------------------------------------------------------
    def _enabled(self) -> list[tuple]:
        """Every event that can happen now."""
        acts: list[tuple] = []
        live = [p for p in self.procs if p.alive and not p.done]
        for p in live:
            w = p.waiting
            if isinstance(w, Query):
                if w.answer is not None:
                    acts.append(("resume", p.pid))
                elif self._recorded(w.pids, p.known):
                    acts.append(("notice", p.pid))  # its DeathWatch reads a new death record
            elif isinstance(w, Program):
                if w.result is not None or w.failed:
                    acts.append(("resume", p.pid))
                elif any((q, w.entry[q]) in self.records for q in w.key[0]):
                    acts.append(("tripwire", p.pid))  # a member of its program is recorded dead
            elif w == "admission" and (p.pid in self.admissions or self._members_gone()):
                acts.append(("resume", p.pid))
        if self.kills_left and len(live) > 1:
            acts += [("kill", p.pid) for p in live]
            acts += [("cut", p.pid) for p in live]  # cut off (its host, its network): no launcher sees it
        if self.pending_launcher:
            acts.append(("launcher",))
        for p in self.procs:
            if not p.alive and p.pid in self.service.alive and not any(e[1] == p.pid for e in self.pending_launcher):
                acts.append(("heartbeat", p.pid))  # the service notices the death (or the retired life's)
            # a restart connects once the service declared its previous life dead (the forget wait),
            # or once the members dropped it (the early connect)
            launching = any(e[1] == p.pid for e in self.pending_launcher)
            forgotten = p.pid not in self.service.alive or self._may_connect(p.pid)
            if not p.alive and forgotten and not launching and not self._over():
                acts.append(("restart", p.pid))
        return acts

    def _may_connect(self, pid: int) -> bool:
        """The early connect (:func:`jaxft.protocol.restart_may_connect`): every process alive
        at ``pid``'s death (a kill its launcher saw) dropped the dead life since, or died itself."""
        if not self.options.early_connect or pid not in self.witnesses:
            return False
        life, others = self.witnesses[pid]
        return all((pid, life, w) in self.dropped or not self.procs[w].alive or self.procs[w].life != w_life
                   for w, w_life in others.items())

    def _over(self) -> bool:
        return any(p.done for p in self.procs)

    def _kill(self, pid: int, seen_by_launcher: bool = True) -> None:
        """``pid`` dies; its launcher sees it (a kill: it retires the life, then records the
        death) or not (its host died, or was cut off: only the service's heartbeat notices,
        and a cut-off process that comes back is ended by the service, never rejoins as is)."""
        p = self.procs[pid]
        life = self.service.incarnation[pid]
        p.alive, p.gen, p.waiting = False, None, None
        self.kills_left -= 1
        self.ready.discard(pid)
        self.admissions.pop(pid, None)
        self.witnesses.pop(pid, None)
        if seen_by_launcher and self.options.retire:  # (the launcher lets a restart connect early only then)
            self.witnesses[pid] = (life, {q.pid: q.life for q in self.procs if q.alive and q.pid != pid})
            self.pending_launcher.append(("retire", pid, life))
        if seen_by_launcher:
            self.pending_launcher.append(("record", pid, life))

    def _launcher(self) -> None:
        what, pid, life = self.pending_launcher.pop(0)
        if what == "retire":
            self.service.new_life(pid)
        else:
            self.records.add((pid, life))

    def _restart(self, pid: int) -> None:
        p = self.procs[pid]
        p.life += 1
        self.service.new_life(pid)
        p.registered = self.service.incarnation[pid]
        self.log.append(f"restart {pid}")
        self._resume_new(p, joiner=self.published)

    def _resume_new(self, p: _Proc, joiner: bool) -> None:
        p.start(joiner)
        self._wire(p)

    def _wire(self, p: _Proc) -> None:
        """Register what ``p`` now waits on (a program joins its instance)."""
        w = p.waiting
        if isinstance(w, Program) and not getattr(w, "wired", False):
            w.wired = True  # type: ignore[attr-defined]
            inst = self.programs.setdefault(w.key, {})
            inst[p.pid] = w
            if set(inst) == set(w.key[0]):
                result = {q: t.contribution for q, t in inst.items()}
                for t in inst.values():
                    t.result = result
                    t.ready = frozenset(self.ready)  # type: ignore[attr-defined]  # the votes it carried
                del self.programs[w.key]

    def _step(self, p: _Proc) -> None:
        try:
            p.waiting = p.gen.send(None)
        except StopIteration:
            p.waiting = None
            if getattr(p, "crashed", False):  # it raised: its launcher sees it exit, as a kill
                p.crashed = False
                self.kills_left += 1  # (not a kill of the schedule's)
                self._kill(p.pid)
            else:
                p.done = True
            return
        self._wire(p)

    def _fail_program(self, p: _Proc) -> None:
        w = p.waiting
        w.failed = True
        inst = self.programs.get(w.key, {})
        if inst.get(p.pid) is w:
            del inst[p.pid]
            if not inst:
                self.programs.pop(w.key, None)

    # how likely each event is next: the launcher and a member's own moves are fast, a kill
    # rare, the service's heartbeat and a restart slow (seconds), and a slow member slower
    WEIGHTS = {"resume": 10.0, "notice": 10.0, "tripwire": 10.0, "launcher": 10.0, "kill": 0.6, "cut": 0.2,
               "heartbeat": 0.4, "restart": 0.4}

    def _weight(self, act: tuple) -> float:
        kind = act[0]
        w = self.WEIGHTS[kind]
        if kind == "resume" and isinstance(self.procs[act[1]].waiting, Program):
            w *= self.speed[act[1]]  # (a late member is slow in its own work: its queries' threads are not)
        return w

    def _stuck(self) -> list[_Proc]:
        """Processes in a program that cannot complete now: its collective timeout may end it."""
        return [p for p in self.procs if p.alive and not p.done and isinstance(p.waiting, Program)
                and p.waiting.result is None and not p.waiting.failed]

    def run(self) -> None:
        for p in self.procs:
            self._resume_new(p, joiner=False)
        for clock in range(self.budget):
            self.clock = clock
            if all(p.done or not p.alive for p in self.procs) and not self.pending_launcher:
                break
            acts = self._enabled()
            if not acts:  # nothing can move: a bound ends a wait
                stuck = self._stuck()
                if stuck:
                    self._fail_program(self.rng.choice(stuck))  # the collective timeout
                else:  # the barrier watchdog (or the admission timeout): the process exits, and restarts
                    waiting = [p for p in self.procs if p.alive and not p.done]
                    if not waiting:
                        raise Violation("bounded: nothing can move, and nobody waits")
                    self.watchdog_exits += 1
                    self.kills_left += 1  # (not one of the schedule's kills)
                    self._kill(self.rng.choice(waiting).pid)
                continue
            kind, *args = self.rng.choices(acts, [self._weight(a) for a in acts])[0]
            if kind in ("resume", "notice"):
                self._step(self.procs[args[0]])
            elif kind == "tripwire":
                self._fail_program(self.procs[args[0]])
            elif kind in ("kill", "cut"):
                self._kill(args[0], seen_by_launcher=kind == "kill")
            elif kind == "launcher":
                self._launcher()
            elif kind == "heartbeat":
                self.service.heartbeat_timeout(args[0])
            elif kind == "restart":
                self._restart(args[0])
        else:
            raise Violation(f"bounded: not finished after {self.budget} events")
        ends = {(p.step, p.state) for p in self.procs if p.alive and p.done and not getattr(p, "left_run", False)}
        if len(ends) > 1 or any(step != self.target for step, _ in ends):
            raise Violation(f"agreement: the survivors ended at {sorted(ends)}")


@dataclasses.dataclass
class Report:
    """What :func:`explore` found over its seeds."""

    schedules: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)  # one line each, with its seed
    desyncs: int = 0  # programs that failed everywhere on the step votes
    watchdog_exits: int = 0  # waits that only a bound ended


def explore(seeds: range, options: Options = Options(), **kw: Any) -> Report:
    """Run every seed; what broke, and how often the guards and the bounds acted."""
    report = Report()
    for seed in seeds:
        sim = Simulation(seed, options=options, **kw)
        report.schedules += 1
        try:
            sim.run()
        except Violation as e:
            report.violations.append(f"seed {seed}: {e}")
        report.desyncs += sim.desyncs
        report.watchdog_exits += sim.watchdog_exits
    return report

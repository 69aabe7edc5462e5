"""Which node runs which rank's agent, and what to do when a node is lost (no I/O).

``jaxft slurm`` (:mod:`jaxft.supervisor.slurm`) runs one agent (``jaxft launch --node-rank R``)
per training rank on the nodes of its allocation and keeps the rest as spares. It feeds a
:class:`NodePlan` what it sees (an agent's heartbeat, an agent's exit, the time, the nodes
SLURM reports down) and carries out the actions it returns (:class:`Start`, :class:`Stop`,
:class:`Lost`, :class:`End`). The plan decides:

* an agent whose heartbeat stopped for ``node_timeout_s`` (or that never beat within
  ``start_timeout_s``, or whose ``srun`` ended without its last word) is lost with its node;
* a lost rank gets a new agent at once on a spare node; without one, on a node lost before
  (the same one too) once ``retry_s`` has passed and SLURM does not report it down; a node
  that fails again waits ``retry_s`` more;
* an agent that ended by itself (its last word, ``exit CODE``) is done: training ended there;
  once one is done no new agent starts, and the job ends when every agent has ended: 0 when
  every one that ended by itself said 0;
* a rank that needs more than ``max_replacements`` new agents ends the job (a node that
  cannot keep an agent alive is not a fault to retry forever).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence


class Why(enum.StrEnum):
    """Why an agent starts on a node."""

    FIRST = "first"
    SPARE = "spare"  # a node kept in reserve (JAXFT_SPARE_NODES)
    RETURNED = "returned"  # a node lost before, tried again


@dataclasses.dataclass(frozen=True)
class Start:
    rank: int
    node: str
    generation: int  # counts the agents started for this rank, from 0
    why: Why


@dataclasses.dataclass(frozen=True)
class Stop:
    """End this agent's ``srun`` (its node is lost, or the job ends)."""

    rank: int
    generation: int


@dataclasses.dataclass(frozen=True)
class Lost:
    rank: int
    node: str
    reason: str


@dataclasses.dataclass(frozen=True)
class End:
    code: int
    reason: str


Action = Start | Stop | Lost | End


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """The bounds of :class:`NodePlan` (seconds)."""

    node_timeout_s: float = 10.0  # heartbeat silence that loses a node
    start_timeout_s: float = 60.0  # a new agent's first heartbeat
    retry_s: float = 5.0  # before a lost node is tried again
    max_replacements: int = 10  # new agents per rank


@dataclasses.dataclass
class _Agent:
    node: str
    generation: int
    started: float
    beat: str | None = None
    beat_at: float | None = None  # when ``beat`` last changed, on the watcher's clock
    exit_code: int | None = None  # its last word: it ended by itself


class NodePlan:
    """Ranks ``0..K-1`` on ``nodes[:K]``, the rest spares (``nodes[0]``: the batch node, rank 0)."""

    def __init__(self, nodes: Sequence[str], spares: int, options: PlanOptions = PlanOptions()):
        if not 0 <= spares < len(nodes):
            raise ValueError(f"{spares} spare nodes leave no node to train on (the job has {len(nodes)})")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"a node is listed twice: {list(nodes)}")
        self.options = options
        self.ranks = len(nodes) - spares
        self.spares: list[str] = list(nodes[self.ranks:])
        self.failed: dict[str, float] = {}  # node -> when it may be tried again
        self.agents: dict[int, _Agent] = {}  # rank -> its current agent
        self.waiting: set[int] = set()  # ranks without an agent (no node to run one)
        self.replacements = dict.fromkeys(range(self.ranks), 0)
        self.finished: dict[int, int] = {}  # rank -> the code its agent ended with by itself
        self._first = list(nodes[:self.ranks])
        self._generations: dict[int, int] = {}  # rank -> its latest agent's generation
        self.ended: End | None = None

    def start(self, now: float) -> list[Action]:
        """The first agents: rank r on ``nodes[r]``."""
        return [self._start(r, node, Why.FIRST, now) for r, node in enumerate(self._first)]

    def _start(self, rank: int, node: str, why: Why, now: float) -> Start:
        generation = self._generations.get(rank, -1) + 1
        self._generations[rank] = generation
        self.agents[rank] = _Agent(node, generation, now)
        self.waiting.discard(rank)
        return Start(rank, node, generation, why)

    # -- what the watcher sees -------------------------------------------------------------------
    def beat(self, rank: int, generation: int, text: str | None, now: float) -> list[Action]:
        """The heartbeat file of ``rank``'s agent ``generation`` reads ``text``."""
        a = self.agents.get(rank)
        if a is None or a.generation != generation or text is None or text == a.beat:
            return []
        a.beat, a.beat_at = text, now
        word, _, code = text.partition(" ")
        if word == "exit" and code.lstrip("-").isdigit():
            a.exit_code = int(code)
        return []

    def exited(self, rank: int, generation: int, now: float) -> list[Action]:
        """``rank``'s agent ``generation`` (its ``srun``) ended; its last word, if any, was fed first."""
        a = self.agents.get(rank)
        if a is None or a.generation != generation:
            return []
        if a.exit_code is not None:
            del self.agents[rank]
            self.finished[rank] = a.exit_code
            return self._maybe_end()
        return self._lose(rank, "its srun ended without the agent's last word", now, stop=False)

    def tick(self, now: float, down: Iterable[str] = ()) -> list[Action]:
        """Time passed; ``down``: the nodes SLURM now reports down or not responding."""
        out: list[Action] = []
        o = self.options
        for rank, a in sorted(self.agents.items()):
            if a.exit_code is not None:
                continue
            if a.beat_at is None and now - a.started > o.start_timeout_s:
                out += self._lose(rank, f"no heartbeat {o.start_timeout_s:g} s after its start", now)
            elif a.beat_at is not None and now - a.beat_at > o.node_timeout_s:
                out += self._lose(rank, f"no heartbeat for {now - a.beat_at:.1f} s", now)
        if self.ended is None and not self.finished:
            for rank in sorted(self.waiting):
                out += self._replace(rank, now, set(down))
        return out + self._maybe_end()

    # -- decisions ---------------------------------------------------------------------------------
    def _lose(self, rank: int, reason: str, now: float, stop: bool = True) -> list[Action]:
        a = self.agents.pop(rank)
        out: list[Action] = [Stop(rank, a.generation)] if stop else []
        out.append(Lost(rank, a.node, reason))
        self.failed[a.node] = now + self.options.retry_s
        self.waiting.add(rank)
        if self.finished:  # training ended: nothing to replace
            self.waiting.discard(rank)
        return out

    def _replace(self, rank: int, now: float, down: set[str]) -> list[Action]:
        picked = self._pick(now, down)
        if picked is None:
            return []
        if self.replacements[rank] >= self.options.max_replacements:
            self.ended = End(1, f"rank {rank} lost its agent {self.replacements[rank] + 1} times")
            return [self.ended]
        node, why = picked
        if why is Why.SPARE:
            self.spares.remove(node)
        self.failed.pop(node, None)
        self.replacements[rank] += 1
        return [self._start(rank, node, why, now)]

    def _pick(self, now: float, down: set[str]) -> tuple[str, Why] | None:
        """A spare; else the node lost longest ago that may be tried again and is not down."""
        if self.spares:
            return self.spares[0], Why.SPARE
        busy = {a.node for a in self.agents.values()}
        ready = [n for n, at in self.failed.items() if at <= now and n not in down and n not in busy]
        return (min(ready, key=lambda n: self.failed[n]), Why.RETURNED) if ready else None

    def _maybe_end(self) -> list[Action]:
        if self.ended is not None or self.agents or (self.waiting and not self.finished):
            return []
        bad = {r: c for r, c in self.finished.items() if c != 0}
        if not self.finished:
            self.ended = End(1, "every agent was lost")
        elif bad:
            codes = ", ".join(f"rank {r}: {c}" for r, c in sorted(bad.items()))
            self.ended = End(1, f"agents ended with errors ({codes})")
        else:
            self.ended = End(0, "training ended")
        return [self.ended]

"""The options of the worker's objects, each a small frozen value (checked when built).

``ElasticLoop(step, state, data, runtime=rt, options=LoopOptions(...), batching=Batching(...))``,
``ElasticTrainer(..., options=LoopOptions(...), reduction=Reduction(...))``,
``ElasticCheckpointer(directory, ..., options=CheckpointOptions(...))`` and
``initialize(..., options=InitOptions(...))``: a default-constructed option is the default
behaviour, and every wait comes from :class:`~jaxft.Timeouts` alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

REDUCTIONS = ("allreduce", "allreduce64", "exact")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """When the loop stops retrying.

    ``min_members``: commit no step with fewer live processes; wait for more (up to
    ``Timeouts.barrier``), then raise :class:`~jaxft.errors.TooFewMembers`.
    ``max_attempts``: failed attempts in a row at one step before
    :class:`~jaxft.errors.RetryBudgetExceeded` (None: unbounded; a step run and undone by a
    later step's failure, with ``commit_every``, does not count as progress).
    """

    min_members: int = 1
    max_attempts: int | None = 100

    def __post_init__(self) -> None:
        if self.min_members < 1:
            raise ValueError(f"min_members must be >= 1, got {self.min_members}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 or None, got {self.max_attempts}")


@dataclasses.dataclass(frozen=True)
class LoopOptions:
    """How :class:`~jaxft.ElasticLoop` (and :class:`~jaxft.ElasticTrainer`) runs its steps.

    ``retry``: :class:`RetryPolicy`.
    ``pipeline``: start step k+1's program as soon as step k's has ended, before step k's
    commit query; what commits is unchanged (steady state only: the run's end known, nobody
    joining, no stop asked, no fault rule of this process at step k+1). ``on_commit`` runs once
    the early program ended; a caller of ``try_step`` that runs programs of its own between
    steps calls ``settle()`` first.
    ``commit_every``: one commit query for up to N steps, all committed or none (a failure
    undoes the steps since the last commit everywhere and runs them again). A step commits
    alone when joiners are admitted, the members just changed, the run ends, or a member was
    asked to stop. ``on_commit`` runs once per commit (a checkpoint's ``every`` must be a
    multiple of N). ``"auto"`` (default): each member measures its steps and commit queries
    and batches only where the query is a noticeable share of a short step
    (:mod:`jaxft.core.batching`: at most 16 steps and 0.5 s of training under one query, none
    in the first 16 steps, none with a state over a tenth of a device's memory, none before a
    step at which a fault rule may fire); an :class:`~jaxft.ElasticCheckpointer` commits alone
    each step it saves. ``1``: every step commits alone (``on_commit`` after every step).
    ``check_every``: every N steps, all members compare their state bit for bit
    (:class:`~jaxft.errors.ConsistencyError`; 0: never).
    ``precompile``: after the members change, process 0 compiles, in the background, the step
    for each member set one failure away while there are at most this many members (0: only, on
    CPU with every process a member, one set one death away, whose program the other sets of
    its width load; with hot spares, ``jaxft launch --spares``, the sets a swap away are warmed
    up regardless).
    ``admission``: when a restarted process becomes a member (:class:`~jaxft.ElasticGroup`):
    ``"ready"`` (default: it sets up while the members train, and enters at a step boundary
    they agree on, carried by the step's votes) or ``"connect"`` (once it connects; the members
    wait for its set-up).
    """

    retry: RetryPolicy = RetryPolicy()
    pipeline: bool = False
    commit_every: int | str = "auto"
    check_every: int = 0
    precompile: int = 0
    admission: str = "ready"

    @property
    def auto_commit(self) -> bool:
        """Whether each member decides how many steps a commit covers (``commit_every="auto"``)."""
        return self.commit_every == "auto"

    @property
    def batches(self) -> bool:
        """Whether a commit may cover several steps."""
        return self.auto_commit or int(self.commit_every) > 1

    def __post_init__(self) -> None:
        if self.admission not in ("ready", "connect"):
            raise ValueError(f"admission must be 'ready' or 'connect', got {self.admission!r}")
        if self.commit_every != "auto" and (not isinstance(self.commit_every, int) or self.commit_every < 1):
            raise ValueError(f"commit_every must be 'auto' or an int >= 1, got {self.commit_every!r}")
        if self.check_every < 0 or self.precompile < 0:
            raise ValueError("check_every and precompile must be >= 0")


def parse_commit_every(value: int | str) -> int | str:
    """A command line's ``commit_every``: ``"auto"`` or an int >= 1 (ValueError otherwise)."""
    if value == "auto":
        return "auto"
    n = int(value)
    if n < 1:
        raise ValueError(f"commit_every must be 'auto' or an int >= 1, got {value!r}")
    return n


def valid_commit_every(value: int | str) -> bool:
    """Whether :func:`parse_commit_every` takes ``value`` (a flag validator)."""
    try:
        parse_commit_every(value)
    except ValueError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Batching:
    """How a global batch is laid out for a step function.

    Flat (default): ``batch [P, ...]`` and ``mask [P]`` sharded over the members. ``stacked``:
    ``batch [M, D*m, ...]`` and ``mask [M, D*m]`` (``M`` micro-batches of ``micro_batch``
    examples per device, for gradient accumulation inside the step). ``chunk`` (stacked):
    micro-batches of exactly ``chunk`` examples whatever the width (what a step whose bits must
    not depend on the width needs)."""

    micro_batch: int | None = None
    stacked: bool = False
    chunk: int | None = None

    @property
    def micro(self) -> int | None:
        """The micro-batch size a stacked layout uses (None when flat)."""
        return self.micro_batch if self.stacked else None


@dataclasses.dataclass(frozen=True)
class MeshStep:
    """A step function built per mesh: ``build(mesh) -> step`` (for steps whose code depends on
    the mesh). ``takes_votes``: with ready admission, the built step takes the votes and returns
    their agreement itself, ``(state, batch, mask, votes[D, W]) -> (state, metrics, agreed[W])``
    (see :func:`jaxft.worker.programs.agreed_votes`), so that it can sum them in its own
    collective (``ElasticTrainer``'s step does: one buffer, one all-reduce)."""

    build: Callable[[Any], Callable]
    takes_votes: bool = False


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How :class:`~jaxft.ElasticTrainer` sums the gradients over the members.

    ``"allreduce"`` (default): one all-reduce; a run with failures ends within ~1e-6 relative
    of a fault-free one (the float order depends on the width; measured: docs/benchmarks.md,
    'Figures behind the code'). ``"allreduce64"``: fixed ``chunks`` per global batch summed in
    float64, rounded once (in practice the fault-free bits, at twice the all-reduce's bytes).
    ``"exact"``: bitwise independent of the width by construction (an all-gather of ``chunks``
    gradients). ``micro_batch``: examples per device per micro-batch (``"allreduce"``; gradient
    accumulation)."""

    kind: str = "allreduce"
    chunks: int | None = None
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.kind!r}")
        if self.kind == "allreduce" and self.chunks is not None:
            raise ValueError("chunks is for the 'exact' and 'allreduce64' reductions")
        if self.chunks is not None and self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks}")


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """What :class:`~jaxft.ElasticCheckpointer` keeps: a save every ``every`` committed steps
    (0: only when asked), the newest ``keep`` complete checkpoints (None: all), and
    ``metadata`` stored with each (a checkpoint of other metadata is refused on restore)."""

    every: int = 0
    keep: int | None = 3
    metadata: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every must be >= 0, got {self.every}")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {self.keep}")


@dataclasses.dataclass(frozen=True)
class InitOptions:
    """How :func:`jaxft.initialize` connects this process (beyond who it is and the timeouts).

    ``external_coordinator``: no worker hosts the service (what ``jaxft launch`` and ``jaxft
    coordinator`` provide; None: from the launcher's environment). ``run_dir``: where the run's
    events go (None: ``$JAXFT_RUN_DIR``). ``gloo_interface``: the network interface of the CPU
    collectives. ``wait_until_forgotten``: a restarted process connects only once the service
    has declared its previous life dead (what ready admission needs). ``compilation_cache``:
    jax's persistent compilation cache, shared by the run's processes (a path; None:
    ``$JAXFT_COMPILATION_CACHE``, a directory shared across runs, else ``<run_dir>/xla_cache``;
    False: off)."""

    external_coordinator: bool | None = None
    run_dir: str | None = None
    gloo_interface: str | None = None
    wait_until_forgotten: bool = True
    compilation_cache: str | bool | None = None

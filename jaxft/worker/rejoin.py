"""Rejoin: who is new, who is behind, who donates, and the state transfer.

A restarted (or late) process enters the live set with an old or empty state. Inside the
first step whose member map has a member the others had not committed with
(:func:`is_new`, computed from the agreed map alone, so every member gets the same answer
without a round trip), every member reports its step and the signature of its state's
structure (:func:`agree`); a member whose structure differs from the reference is refused
before anything moves, and the members behind receive the state of the lowest-numbered
member holding the latest step (the donor), bit for bit, through
:func:`jaxft.worker.transfer.broadcast_tree`. The data position and the RNG are functions of the
step, so the step and the state are all a joiner needs. The same happens after the members
found that they ran different steps (a member committed a step the others failed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxft.core.rejoin import donor, reference
from jaxft.errors import StateMismatch
from jaxft.protocol import Event
from jaxft.types import PyTree
from jaxft.worker import kv, transfer
from jaxft.worker.arrays import structure_text


@dataclasses.dataclass(frozen=True)
class Rehydration:
    """What one joiner received (logged as the ``rehydrated`` event)."""

    step: int  # the step it now holds
    from_step: int  # the step it held before
    donor: int
    bytes: int
    seconds: float


SIGNATURE_KEY = "jaxft/state_signature"


@dataclasses.dataclass(frozen=True)
class Signature:
    """The structure of a state pytree: its treedef and each leaf's path, dtype and shape.

    Two processes whose signatures differ hold different models (or optimizers): moving one's
    state into the other would silently train a model nobody started, so a joiner whose
    signature differs from the members' is refused before anything moves."""

    lines: tuple[str, ...]  # "treedef ...", then "<path>: <dtype>[<shape>]" per leaf

    @classmethod
    def of(cls, tree: PyTree) -> Signature:
        """The signature of ``tree`` (its treedef's text without object addresses,
        :func:`~jaxft.worker.arrays.structure_text`: the same in every process)."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        return cls((f"treedef {structure_text(treedef)}",) + tuple(
            f"{jax.tree_util.keystr(k)}: {np.dtype(getattr(x, 'dtype', np.asarray(x).dtype)).name}{list(np.shape(x))}"
            for k, x in leaves))

    @property
    def digest(self) -> bytes:
        return hashlib.sha256("\n".join(self.lines).encode()).digest()

    def words(self) -> np.ndarray:
        """The digest's first 16 bytes as two int64 (what the members all-gather)."""
        return np.frombuffer(self.digest[:16], np.int64).copy()

    def difference(self, other: Signature) -> str:
        """The first difference from ``other``, in words."""
        mine, theirs = dict(_split(self.lines)), dict(_split(other.lines))
        for key in [k for k in theirs if k in mine] + [k for k in mine if k not in theirs]:
            if mine.get(key) != theirs.get(key):
                return f"{key}: {mine.get(key, 'absent')} here, {theirs.get(key, 'absent')} in the members'"
        missing = [k for k in theirs if k not in mine]
        if missing:
            return f"{missing[0]}: absent here, {theirs[missing[0]]} in the members'"
        return "the trees differ"


def _split(lines: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(line.split(": ", 1)[0], line.split(": ", 1)[1]) if ": " in line else ("tree", line) for line in lines]


def publish_signature(signature: Signature) -> None:
    """Record the members' state signature in the coordination service (for joiners to compare)."""
    kv.client().key_value_set(SIGNATURE_KEY, json.dumps(signature.lines), allow_overwrite=True)


def published_signature() -> Signature | None:
    """The signature the members published, if any."""
    value = kv.try_get(SIGNATURE_KEY)
    return Signature(tuple(json.loads(value))) if value else None


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What the members of a step agreed on before any state moves (:func:`agree`)."""

    steps: dict[int, int]  # process -> the step it holds
    generation: int  # the highest generation among them
    donor: int  # the lowest process at the latest step with the reference signature
    refused: tuple[int, ...]  # processes whose state signature differs from the reference


def _agree_row(step: int, generation: int, signature: Signature) -> np.ndarray:
    """What each member contributes to :func:`agree`: ``[4]`` int64 (step, generation, and the
    signature's two words)."""
    return np.concatenate([np.array([step, generation], np.int64), signature.words()])


def compile_agree(mesh: Mesh) -> None:
    """Compile, without running, :func:`agree`'s all-gather over ``mesh`` (ahead of a swap or a
    rejoin: the agreement otherwise compiles it while every member waits)."""
    transfer.compile_allgather(len(_agree_row(0, 0, Signature(()))), np.int64, mesh)


def agree(step: int, generation: int, signature: Signature, members) -> Agreement:
    """All-gather every member's ``(step, generation, signature)`` and decide who donates and
    who is refused (:func:`reference`); a collective over ``members``."""
    rows = transfer.allgather_rows(_agree_row(step, generation, signature), members.mesh)
    procs = [d.process_index for d in members.devices]
    steps = {p: int(r[0]) for p, r in zip(procs, rows)}
    signatures = {p: r[2:4].tobytes() for p, r in zip(procs, rows)}
    donor_, refused = reference(steps, signatures)
    return Agreement(steps, int(rows[:, 1].max()), donor_, refused)


def rehydrate(step: int, state: PyTree, members, me: int, steps: Mapping[int, int],
              on_start: Callable[[], None] | None = None) -> tuple[int, PyTree, Rehydration | None]:
    """Bring every member to the donor's ``(step, state)``; a collective over ``members``.

    ``steps`` is :func:`agree`'s map (every member's signature matching). Returns this process's new step and state, and
    a :class:`Rehydration` if this process was behind (None for the donor and bystanders
    already up to date). With every member at the same step nothing moves. ``on_start``
    runs once the transfer is decided, before any byte moves (the ``during-rehydrate``
    fault point).
    """
    latest = max(steps.values())
    if all(s == latest for s in steps.values()):
        return step, state, None
    if on_start is not None:
        on_start()
    source = donor(steps)
    t0 = time.perf_counter()
    payload = {"step": np.int64(step), "state": state}
    got = transfer.broadcast_tree(payload, source, members.mesh)
    info = None
    if steps[me] != latest:
        info = Rehydration(step=latest, from_step=steps[me], donor=source, bytes=transfer.tree_nbytes(payload),
                           seconds=round(time.perf_counter() - t0, 4))
    return int(got["step"]), got["state"], info


class Refused(Exception):
    """Members whose state does not match the members' left a step untouched (they exit)."""

    def __init__(self, processes: list[int]):
        super().__init__(f"processes {processes} hold a state that does not match the members'; they leave")
        self.processes = processes


class StateSync:
    """One loop's side of the rejoin: its state's signature, published once per life by the
    lowest member, checked by a restart before it asks to be admitted, and agreed in every step
    that brings members together (:func:`agree`, then :func:`rehydrate`)."""

    def __init__(self, group: Any, events: Any, faults: Any):
        self.group, self.events, self.faults = group, events, faults
        self._signature: Signature | None = None
        self._published = False

    def signature(self, state: PyTree) -> Signature:
        """The structure of the loop's state, computed once (a restore or a rehydration brings
        values, never a new structure: both check it)."""
        if self._signature is None:
            self._signature = Signature.of(state)
        return self._signature

    def sync(self, step: int, state: PyTree, members: Any) -> tuple[int, PyTree, Rehydration | None]:
        """Agree on the step and the state's structure; bring members behind the latest step to the
        donor's. A member whose structure differs from the reference (a restart with another
        model) is refused before anything moves: it raises :class:`~jaxft.errors.StateMismatch` (a
        configuration error: it exits 78, not restarted); the others raise :class:`Refused`, leave
        the step untouched and go on."""
        me = self.group.process_id
        agreed = agree(step, self.group.generation, self.signature(state), members)
        self.group.generation = agreed.generation  # (the one the members agreed on)
        if agreed.refused:
            self.events.log(Event.STATE_MISMATCH, step=step, refused=list(agreed.refused), donor=agreed.donor)
            if me in agreed.refused:
                raise StateMismatch(f"process {me}'s state does not match the running members' (process "
                                    f"{agreed.donor}'s): its structure differs (treedef, shapes or dtypes); start "
                                    "every process with the same model and optimizer")
            raise Refused(list(agreed.refused))
        return rehydrate(step, state, members, me, agreed.steps,
                         on_start=lambda: self.faults.point("during-rehydrate", step))

    def joined(self, rehydrated: Rehydration) -> None:
        """The step that rehydrated this process committed: the ``join`` and ``rehydrated`` events."""
        self.events.log(Event.JOIN, step=rehydrated.from_step, process=self.group.process_id)
        self.events.log(Event.REHYDRATED, **dataclasses.asdict(rehydrated))

    def publish(self, process_ids: tuple[int, ...], state: PyTree) -> None:
        """Once per life, the lowest member publishes the structure (ready admission, several processes)."""
        if self._published or self.group.admission != "ready" or jax.process_count() == 1:
            return
        self._published = True
        if self.group.process_id == min(process_ids):
            publish_signature(self.signature(state))

    def check_before_admission(self, state: PyTree) -> None:
        """A restart, before it tells the members it is ready: a structure other than the one they
        published is refused here, before anything moves (one line, exit 78)."""
        published = published_signature()
        mine = self.signature(state)
        if published is not None and published.digest != mine.digest:
            raise StateMismatch(f"process {self.group.process_id}'s state does not match the running members': "
                                f"{mine.difference(published)}; start every process with the same model and "
                                "optimizer")

"""Deterministic global batches, split over whoever is alive.

Step ``k`` always trains on the same ``G`` examples, drawn from the dataset by a seeded
permutation per epoch, so a step retried on fewer processes sees exactly the same data.
The batch is padded to a multiple of the device count and masked; the trainer divides
the loss by ``G``, never by the number of live devices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxft.types import PyTree


class BatchSource(Protocol):
    """What the loop trains on: step ``k``'s global batch of :attr:`global_batch` examples
    (:class:`GlobalBatches`, :class:`jaxft.GrainBatches` or your own). A source that also has
    ``local_batch(step, positions)`` is asked only for the examples this process's devices
    hold (:func:`step_batch`)."""

    @property
    def global_batch(self) -> int:
        """``G``, examples per step, independent of the number of processes."""

    def batch(self, step: int) -> PyTree:
        """Step ``step``'s whole global batch ``[G, ...]``."""


class GlobalBatches:
    """Maps a step number to the same global batch of ``global_batch`` examples.

    Args:
      dataset: a pytree of arrays sharing the leading dimension ``N``.
      global_batch: ``G``, examples per step, independent of the number of processes.
      seed: the permutation of epoch ``e`` is ``default_rng([seed, e]).permutation(N)``.
      shuffle: if False, examples are taken in order.
    """

    def __init__(self, dataset: PyTree, global_batch: int, seed: int = 0, shuffle: bool = True):
        leaves = jax.tree_util.tree_leaves(dataset)
        if not leaves:
            raise ValueError("dataset has no arrays")
        sizes = {int(np.shape(x)[0]) for x in leaves}
        if len(sizes) != 1:
            raise ValueError(f"dataset arrays disagree on the number of examples: {sorted(sizes)}")
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        self.dataset = jax.tree_util.tree_map(np.asarray, dataset)
        self.num_examples = sizes.pop()
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            perm = (np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
                    if self.shuffle else np.arange(self.num_examples))
            self._perm_cache = {epoch: perm}  # keep one epoch: steps move forward
        return perm

    def indices(self, step: int) -> np.ndarray:
        """Dataset indices of step ``step``'s batch, shape ``[G]``."""
        positions = step * self.global_batch + np.arange(self.global_batch)
        epochs, offsets = np.divmod(positions, self.num_examples)
        out = np.empty(self.global_batch, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[offsets[sel]]
        return out

    def batch(self, step: int) -> PyTree:
        """Step ``step``'s batch: the dataset pytree with leading dimension ``G``."""
        idx = self.indices(step)
        return jax.tree_util.tree_map(lambda x: x[idx], self.dataset)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How ``G`` examples are laid out on ``D`` devices in ``M`` micro-batches.

    The device array has shape ``[M, D * m]``: micro-batch ``i`` gives device ``d`` the
    slice ``[d*m, (d+1)*m)`` of row ``i``. Slots past ``G`` are padding (mask 0).
    """

    global_batch: int
    num_devices: int
    num_micro: int
    micro_size: int  # m, examples per device per micro-batch

    @classmethod
    def plan(cls, global_batch: int, num_devices: int, micro_batch: int | None = None) -> Layout:
        per_device = math.ceil(global_batch / num_devices)
        m = per_device if not micro_batch else min(micro_batch, per_device)
        return cls(global_batch, num_devices, math.ceil(per_device / m), m)

    @classmethod
    def chunked(cls, global_batch: int, num_devices: int, chunk: int) -> Layout:
        """Micro-batches of exactly ``chunk`` examples whatever ``D`` (the exact reduction's
        layout): chunk ``j`` of the batch is micro-batch ``j % k`` of device ``j // k``, with
        ``k = ceil(ceil(G / chunk) / D)``; whole padding chunks follow the real ones."""
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        return cls(global_batch, num_devices, math.ceil(math.ceil(global_batch / chunk) / num_devices), chunk)

    @classmethod
    def of(cls, global_batch: int, num_devices: int, micro_batch: int | None = None,
           chunk: int | None = None) -> Layout:
        """:meth:`chunked` if ``chunk`` is given, else :meth:`plan`."""
        return cls.chunked(global_batch, num_devices, chunk) if chunk else cls.plan(global_batch, num_devices,
                                                                                 micro_batch)

    def arrange(self, x: np.ndarray, pad_with_zeros: bool = False) -> np.ndarray:
        """``[G, ...] -> [M, D*m, ...]``.

        Padding slots hold copies of the first example (a real input, so a loss that is
        NaN or inf on zeros cannot poison the masked sum or its gradient), or zeros with
        ``pad_with_zeros`` (for the mask itself).
        """
        d, mm, m = self.num_devices, self.num_micro, self.micro_size
        padded = np.zeros((d * mm * m,) + x.shape[1:], x.dtype)
        padded[: self.global_batch] = x
        if not pad_with_zeros and self.global_batch < padded.shape[0]:
            padded[self.global_batch:] = x[:1]
        # device-major: device d owns examples [d*M*m, (d+1)*M*m) of the padded batch
        return padded.reshape((d, mm, m) + x.shape[1:]).swapaxes(0, 1).reshape((mm, d * m) + x.shape[1:])

    def mask(self) -> np.ndarray:
        return self.arrange(np.ones(self.global_batch, np.float32), pad_with_zeros=True)

    def positions(self, device_index: int) -> np.ndarray:
        """Positions in ``[0, G)`` of the examples device ``device_index`` holds (all micro-batches)."""
        per = self.num_micro * self.micro_size
        return np.arange(device_index * per, min((device_index + 1) * per, self.global_batch))


def local_positions(mesh, global_batch: int, micro_batch: int | None = None,
                    chunk: int | None = None) -> np.ndarray:
    """Positions in ``[0, G)`` of the examples this process's devices hold on ``mesh``."""
    layout = Layout.of(global_batch, mesh.devices.size, micro_batch, chunk)
    me = jax.process_index()
    parts = [layout.positions(i) for i, d in enumerate(mesh.devices.flat) if d.process_index == me]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def step_batch(data, step: int, mesh, micro_batch: int | None = None, chunk: int | None = None) -> PyTree:
    """Step ``step``'s global batch ``[G, ...]`` for placing on ``mesh``.

    A source with ``local_batch(step, positions)`` (e.g. :class:`jaxft.GrainBatches`) loads
    only the examples this process's devices hold; the other rows are zeros that
    :func:`shard_batch` never places. Otherwise ``data.batch(step)``.
    """
    if not hasattr(data, "local_batch"):
        return data.batch(step)
    # Example 0 too: padding slots hold copies of it (never zeros), whichever device owns them.
    positions = np.union1d(local_positions(mesh, data.global_batch, micro_batch, chunk), [0])
    part = data.local_batch(step, positions)

    def spread(x):
        x = np.asarray(x)
        full = np.zeros((data.global_batch,) + x.shape[1:], x.dtype)
        full[positions] = x
        return full

    return jax.tree_util.tree_map(spread, part)


def _placement(global_batch: int, mesh, axis_name: str, micro_batch: int | None, flat: bool,
               chunk: int | None) -> tuple[Layout, NamedSharding]:
    """The layout of a ``[G, ...]`` batch on ``mesh`` and the sharding of its ``[M, D*m, ...]``
    arrangement (``flat``: ``[D*m, ...]``), shared by :func:`shard_batch` and :func:`batch_specs`."""
    if flat and chunk:
        raise ValueError("a chunked layout has several micro-batches: it cannot be flat")
    layout = Layout.of(int(global_batch), mesh.devices.size, None if flat else micro_batch, chunk)
    return layout, NamedSharding(mesh, P(axis_name) if flat else P(None, axis_name))


def batch_specs(template: PyTree, mesh, axis_name: str = "data", micro_batch: int | None = None,
                flat: bool = False, chunk: int | None = None) -> tuple[PyTree, jax.ShapeDtypeStruct]:
    """What :func:`shard_batch` would return for a global batch shaped like ``template``
    (leaves with ``.shape [G, ...]`` and ``.dtype``), as ``jax.ShapeDtypeStruct`` s: enough to
    compile a step for ``mesh`` ahead of time (:mod:`jaxft.worker.warmup`) without the data."""
    layout, sharding = _placement(jax.tree_util.tree_leaves(template)[0].shape[0], mesh, axis_name, micro_batch,
                                  flat, chunk)
    rows: tuple[int, ...] = (layout.num_micro, layout.num_devices * layout.micro_size)
    if flat:
        rows = rows[1:]

    def spec(shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(rows + tuple(shape), dtype, sharding=sharding)

    return (jax.tree_util.tree_map(lambda x: spec(x.shape[1:], x.dtype), template),
            spec((), np.dtype(np.float32)))


def shard_batch(batch: PyTree, mesh, axis_name: str = "data",
                micro_batch: int | None = None, flat: bool = False,
                chunk: int | None = None, mask: jax.Array | None = None) -> tuple[PyTree, jax.Array]:
    """Place a global batch ``[G, ...]`` on ``mesh`` as ``[M, D*m, ...]`` plus its mask
    (``flat``: as ``[D*m, ...]``, one micro-batch; ``chunk``: :meth:`Layout.chunked`).

    Every process passes the same global batch; each only materialises its own slices.
    The mask depends on the layout alone: pass the one an earlier call returned for the
    same ``mesh`` and arguments as ``mask`` to reuse it instead of placing it again.
    """
    layout, sharding = _placement(np.shape(jax.tree_util.tree_leaves(batch)[0])[0], mesh, axis_name, micro_batch,
                                  flat, chunk)

    def place(arranged: np.ndarray) -> jax.Array:
        if flat:
            arranged = arranged[0]
        return jax.make_array_from_callback(arranged.shape, sharding, lambda idx: arranged[idx])

    placed = jax.tree_util.tree_map(lambda x: place(layout.arrange(np.asarray(x))), batch)
    return placed, place(layout.mask()) if mask is None else mask

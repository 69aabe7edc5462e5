"""``GrainBatches``: deterministic global batches from any Grain random-access source.

Step ``k`` always trains on the same ``G`` examples, whatever the number of live processes:
the global order is Grain's ``MapDataset.source(source).shuffle(seed).repeat()`` (a
seeded permutation per epoch), and step ``k`` takes positions ``[k*G, (k+1)*G)`` of it.
Each process loads only the examples its own devices hold in that step
(:func:`jaxft.worker.data.step_batch` asks for them by position), through a Grain ``IterDataset``
that prefetches the next steps with ``num_threads`` threads (and, with ``worker_count``,
Grain's worker processes). When the members change (a death, a rejoin) or a step is
retried, the prefetching pipeline is rebuilt for the new shard from the step asked for.

Needs ``pip install 'jaxft[grain]'``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)


def _stack(examples: Sequence[Any]):
    import jax

    return jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *examples)


class RandomAccessSource(Protocol):
    """What :class:`GrainBatches` reads: a length and an example per index (a Grain data
    source, a list, a ``MapDataset``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


class GrainBatches:
    """Maps a step number to the same global batch of ``global_batch`` examples of ``source``.

    Args:
      source: any random-access source (``__len__`` and ``__getitem__``): a Grain data
        source (``grain.sources.ArrayRecordDataSource``, ...), a list, a ``MapDataset``.
      global_batch: ``G``, examples per step, independent of the number of processes.
      seed: seed of Grain's per-epoch shuffle.
      shuffle: if False, examples are taken in order.
      transform: applied to each example after loading (Grain ``map``), e.g. decoding.
      num_threads: Grain read threads.
      prefetch: Grain's prefetch buffer (in steps).
      worker_count: Grain worker processes (0: load in this process).
    """

    def __init__(self, source: RandomAccessSource, global_batch: int, seed: int = 0, shuffle: bool = True,
                 transform: Callable[[Any], Any] | None = None, num_threads: int = 2, prefetch: int = 4,
                 worker_count: int = 0):
        import grain

        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        self.num_examples = len(source)
        if self.num_examples < 1:
            raise ValueError("the source has no examples")
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        ds = grain.MapDataset.source(source)
        if shuffle:
            ds = ds.shuffle(seed=seed)
        ds = ds.repeat()
        if transform is not None:
            ds = ds.map(transform)
        self.dataset = ds  # position -> example, for every position of every epoch
        self._options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
        self._workers = worker_count
        self._key: tuple | None = None  # (positions, next step) of the live pipeline
        self._it: Iterator[Any] | None = None

    def example(self, position: int):
        """The example at global position ``position`` (step ``position // G``)."""
        return self.dataset[int(position)]

    def batch(self, step: int):
        """Step ``step``'s whole global batch ``[G, ...]`` (every example; for checks and tools)."""
        start = step * self.global_batch
        return _stack([self.example(start + j) for j in range(self.global_batch)])

    def local_batch(self, step: int, positions: np.ndarray):
        """The examples at ``positions`` (in ``[0, G)``) of step ``step``, stacked ``[len, ...]``."""
        wanted = tuple(int(p) for p in positions)
        if not wanted:  # every slot of this process is padding: empty arrays of the right kind
            import jax

            return jax.tree_util.tree_map(lambda x: x[:0], _stack([self.example(step * self.global_batch)]))
        if self._it is None or self._key != (wanted, step):
            self._it = self._pipeline(step, wanted)
        out = next(self._it)
        self._key = (wanted, step + 1)
        return out

    def _pipeline(self, start: int, positions: tuple[int, ...]):
        import grain

        logger.debug("grain pipeline from step %d for %d positions", start, len(positions))
        g, ds = self.global_batch, self.dataset
        pos = np.asarray(positions)
        steps = grain.MapDataset.range(start, 2**62).map(lambda k: _stack([ds[int(k) * g + int(p)] for p in pos]))
        it = steps.to_iter_dataset(self._options)
        if self._workers:
            it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=self._workers))
        return iter(it)

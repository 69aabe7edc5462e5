"""A step's global batch, placed on the members' mesh, and what a member runs on when its
data source fails.

Step ``k`` always gets the same ``G`` examples from ``data`` (:mod:`jaxft.worker.data`), laid
out as :class:`~jaxft.Batching` says. A member whose data source raises must not leave the
step on its own (the others would wait in the step's collective: until gloo's timeout on CPU,
for ever on GPU): it runs the program on placeholders of the batch's shapes with a ``fail``
vote, and every member reads the same verdict, a failed step (:meth:`BatchFeeder.inputs`).
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import Mesh

from jaxft.types import PyTree
from jaxft.worker.arrays import shapes
from jaxft.worker.data import shard_batch, step_batch
from jaxft.worker.options import Batching

logger = logging.getLogger(__name__)


class BatchFeeder:
    """Places each step's batch for one loop; remembers a batch's shapes (the template the
    placeholders, the reference program and the warm-up are built from)."""

    def __init__(self, data, batching: Batching, axis_name: str, process_id: int):
        self.data, self.batching, self.axis_name, self.process_id = data, batching, axis_name, process_id
        self.template: PyTree | None = None  # shapes and dtypes of a host global batch
        self._mask: tuple | None = None  # (mesh, global batch, the placed batch mask)

    @property
    def global_batch(self) -> int:
        return int(self.data.global_batch)

    def forget(self) -> None:
        """Before a backend rebuild: the placed mask belongs to the old backend."""
        self._mask = None

    def host_batch(self, step: int, mesh: Mesh) -> PyTree:
        """Step ``step``'s global batch in host memory, for ``mesh`` (noting its shapes)."""
        host = step_batch(self.data, step, mesh, self.batching.micro, self.batching.chunk)
        if self.template is None:
            self.template = shapes(host)
        return host

    def place(self, step: int, mesh: Mesh) -> tuple[PyTree, jax.Array]:
        """Step ``step``'s batch and mask on ``mesh``."""
        host = self.host_batch(step, mesh)
        # The mask is the same every step on one mesh: placed once. Keyed by the mesh object, not
        # device ids: a backend rebuild brings new devices with the same ids.
        kept = self._mask
        reuse = kept is not None and kept[0] is mesh and kept[1] == self.global_batch
        placed, mask = shard_batch(host, mesh, self.axis_name, self.batching.micro, flat=not self.batching.stacked,
                                   chunk=self.batching.chunk, mask=kept[2] if kept is not None and reuse else None)
        self._mask = (mesh, self.global_batch, mask)
        return placed, mask

    def inputs(self, step: int, mesh: Mesh, voting: bool) -> tuple[tuple[PyTree, jax.Array], Exception | None]:
        """Step ``step``'s placed batch and mask, and None; or, if this member's data source
        raised, placeholders of the same shapes and the error (see the module docstring).
        Without a batch seen yet (its shapes unknown) or without votes (``voting``: ready
        admission), the error is raised as before."""
        try:
            return self.place(step, mesh), None
        except Exception as e:
            if self.template is None or not voting:
                raise
            logger.error("process %d could not build step %d's batch (%s: %s); the step fails everywhere",
                         self.process_id, step, type(e).__name__, e)
            host = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), self.template)
            return shard_batch(host, mesh, self.axis_name, self.batching.micro, flat=not self.batching.stacked,
                               chunk=self.batching.chunk), e

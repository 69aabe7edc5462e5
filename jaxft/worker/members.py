"""What a step tells its body: the agreed live set (:class:`Members`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class Members:
    """The agreed live set for one step."""

    mesh: Mesh  # 1-D mesh over the members' devices (sorted by id) with axis ``axis_name``
    incarnations: Mapping[int, int]  # process id -> coordination-service incarnation
    generation: int  # changes whenever the member map changes
    joined: tuple[int, ...]  # process ids new (or with a new incarnation) since last step
    left: tuple[int, ...]
    reset: bool  # the data plane was synced (rebuilt, or its backend kept) at the start of this step
    gained: bool  # a member (maybe this process) is new since the last committed step:
    # joiners may need state. Every member computes the same value.
    mesh_is_new: bool = False  # first step on this device set: the step function compiles

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return tuple(self.mesh.devices.flat)

    @property
    def process_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.incarnations))

    @property
    def size(self) -> int:
        return self.mesh.devices.size

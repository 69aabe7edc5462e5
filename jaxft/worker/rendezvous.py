"""Connect a member set's gloo communicator the moment its members are known to be alive.

On CPU, XLA opens a gloo communicator per device list lazily, at the first collective over that
list: every member writes its address under ``cpu:gloo/<device ids>/<rank>`` in the
coordination service and reads the others', each read bounded by gloo's fixed 30 s (no
setting). A member that dies after its peers passed the last barrier and before it wrote its
key leaves them in that read for 30 s, out of reach of jaxft's death watch (they are inside one
C++ call). Before, the window was everything a step did before its first collective: building
the batch, loading or compiling the step, the rejoin transfer (measured: docs/benchmarks.md,
'Figures behind the code'). The function :func:`compile_for` returns runs a one-element
all-reduce over the list; called right after the barrier, from a program compiled before it, it
writes the keys within microseconds of the barrier, and the step's own collectives reuse the
connected communicator (gloo caches it per device list). A list within one process has no
rendezvous (nothing is compiled).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

logger = logging.getLogger(__name__)

Connect = Callable[[], None]  # run it on every member of the set at the same point


_connects: dict[tuple[int, ...], Connect] = {}  # by device ids, for the current backend


def forget_programs() -> None:
    """Before a backend rebuild: drop the rendezvous kept per device list (they hold its devices)."""
    _connects.clear()


def compile_for(devices: Sequence[jax.Device]) -> Connect:
    """The rendezvous of ``devices`` (every process's devices of one member set), ready to run:
    a compiled one-element-per-device sum; call the result on every member at the same point.
    Kept per device list until :func:`forget_programs` (the warm-up compiles the likely next
    ones, and the sync then finds them here: lowering and loading it took 14-30 ms a member on
    a swap's way back, docs/benchmarks.md, session 36)."""
    devices = sorted(devices, key=lambda d: d.id)  # the order of the step's mesh (ElasticGroup)
    if len({d.process_index for d in devices}) < 2:
        return lambda: None
    ids = tuple(d.id for d in devices)
    kept = _connects.get(ids)
    if kept is not None:
        return kept
    connect = _compile(devices)
    return _connects.setdefault(ids, connect)


def _compile(devices: list[jax.Device]) -> Connect:
    mesh = Mesh(np.array(devices), ("rendezvous",))
    sharded = NamedSharding(mesh, P("rendezvous"))
    spec = jax.ShapeDtypeStruct((len(devices),), np.dtype(np.int32), sharding=sharded)
    program = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P())).lower(spec).compile()
    local = [d for d in devices if d.process_index == jax.process_index()]

    def connect() -> None:
        t0 = time.monotonic()
        ones = jax.make_array_from_single_device_arrays(
            (len(devices),), sharded, [jax.device_put(np.ones((1,), np.int32), d) for d in local])
        total = int(program(ones))
        if total != len(devices):  # (not expected: every member adds one per device)
            raise RuntimeError(f"gloo rendezvous over {len(devices)} devices summed to {total}")
        logger.debug("gloo rendezvous over %d devices: %.4f s", len(devices), time.monotonic() - t0)

    return connect

"""Test worker: the CPU backend's rendezvous keys and live_devices' state, as jaxft._compat uses them.

Run by tests/test_private_api.py under ``jaxft launch -n 2``. Process 0 logs a
``private_keys`` event: which keys exist after a cross-process computation (and whether
gloo's records advertise its listener as :func:`jaxft._compat.gloo_listen_address` reads
them, and how gloo's event loop watches its connections, as :mod:`jaxft.worker.deadpairs`
finds them), whether :func:`jaxft._compat.delete_stale_cpu_keys` removed them, whether
``live_devices``' map holds incarnations, and whether a backend rebuild (what a rejoin does)
then computes again with the map re-keyed.
"""

import jaxft

rt = jaxft.initialize()

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.extend import backend as jax_backend
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxft import _compat
from jaxft.worker import breaker, deadpairs, kv


def cross_process_sum() -> float:
    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh = Mesh(devices, ("x",))
    local = [d for d in devices if d.process_index == jax.process_index()]
    rows = [jax.device_put(np.full((1,), d.id + 1.0, np.float32), d) for d in local]
    x = jax.make_array_from_single_device_arrays((len(devices),), NamedSharding(mesh, P("x")), rows)
    out = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    return float(np.asarray(out.addressable_data(0)))


def keys(prefix: str) -> list[str]:
    return sorted(k for k, _ in kv.client().key_value_dir_get_bytes(prefix))


def gloo_listener_advertised() -> bool:
    """Whether one of the addresses gloo's records advertise is a listener of this process."""
    mine = breaker.my_sockets()
    table = breaker.tcp_sockets(mine)
    listening = {table[i].local for i in mine if i in table and table[i].state == "0A"}
    values = [v for _, v in kv.client().key_value_dir_get_bytes(_compat.GLOO_KEY_PREFIX)]
    addresses = [_compat.gloo_listen_address(v) for v in values]
    return bool(values) and None not in addresses and any(breaker._endpoint(*a) in listening for a in addresses)


def gloo_pairs_watched() -> list[bool]:
    """For each connected socket gloo's epoll instance watches (found as jaxft.worker.deadpairs
    finds it): whether it is watched level-triggered (what a dead one makes the loop spin on)."""
    mine = breaker.my_sockets()
    table = breaker.tcp_sockets(mine)
    regs = deadpairs.DeadPairs(jax.process_index()).gloo_registrations(table, mine)
    return [not r.events & (_compat.EPOLLET | _compat.EPOLLONESHOT) for r in regs
            if r.inode in table and table[r.inode].state == breaker.ESTABLISHED]


def has(key: str) -> bool:
    try:
        return kv.client().key_value_try_get_bytes(key) is not None
    except Exception:  # noqa: BLE001 - NOT_FOUND is raised
        return False


out = {"sum_before": cross_process_sum()}
with multihost_utils.live_devices(jax.devices()):
    pass
live = _compat.live_device_map()
out["live_map"] = sorted([d.process_index, int(i)] for d, i in live.items())
client = kv.client()
client.wait_at_barrier("pk_computed", 30_000, [0, 1])
if rt.process_id == 0:
    out["gloo_keys_before"] = len(keys(_compat.GLOO_KEY_PREFIX))
    out["topology_before"] = has(_compat.GLOBAL_TOPOLOGY_KEY)
    out["gloo_listener_advertised"] = gloo_listener_advertised()
    out["gloo_pairs_level_triggered"] = gloo_pairs_watched()
    _compat.delete_stale_cpu_keys(client, topology=True)
    out["gloo_keys_after"] = len(keys(_compat.GLOO_KEY_PREFIX))
    out["topology_after"] = has(_compat.GLOBAL_TOPOLOGY_KEY)
client.wait_at_barrier("pk_deleted", 30_000, [0, 1])
jax_backend.clear_backends()  # what a CPU rejoin does; the keys are gone, so gloo can rendezvous again
new_devices = jax.devices()
_compat.rekey_live_devices(new_devices)
out["rekeyed"] = all(any(d is n for n in new_devices) for d in _compat.live_device_map())
with multihost_utils.live_devices(jax.devices()) as agreed:  # raises ProcessFailureError without the re-key
    out["live_after"] = sorted(d.process_index for d in agreed)
out["sum_after"] = cross_process_sum()
if rt.process_id == 0:
    rt.events.log("private_keys", **out)
client.wait_at_barrier("pk_done", 30_000, [0, 1])

"""Test worker: the data-plane breaker ends a gloo collective and spares the program's own TCP.

Run by tests/test_breaker.py under ``jaxft launch -n 2``. Each process holds a connection of
its own: a client socket to a server it listens with on a high port, and the connection that
server accepted. After an all-reduce has connected gloo, process 0 enters another all-reduce
and process 1, instead of joining it, breaks its data plane (:func:`jaxft.worker.breaker.break_data_plane`),
then checks that its own connection still carries data both ways. Each logs a ``breaker``
event: process 0 how its all-reduce ended and after how long, process 1 how many connections
it broke and whether its own connection survived.
"""

import socket
import time

import jaxft

rt = jaxft.initialize()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxft.worker import breaker, kv


def cross_process_sum() -> float:
    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh = Mesh(devices, ("x",))
    local = [d for d in devices if d.process_index == jax.process_index()]
    rows = [jax.device_put(np.full((1,), d.id + 1.0, np.float32), d) for d in local]
    x = jax.make_array_from_single_device_arrays((len(devices),), NamedSharding(mesh, P("x")), rows)
    out = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    return float(np.asarray(out.addressable_data(0)))


def round_trip(a: socket.socket, b: socket.socket) -> bool:
    """Whether ``a`` and ``b`` (two ends of one connection) still carry data both ways."""
    try:
        a.sendall(b"ping")
        b.sendall(b"pong")
        return b.recv(4) == b"ping" and a.recv(4) == b"pong"
    except OSError:
        return False


me = jax.process_index()
c = kv.client()
server = socket.create_server(("127.0.0.1", 0))  # the program's own server, on a high port
mine = socket.create_connection(server.getsockname()[:2], timeout=5)
accepted, _ = server.accept()
accepted.settimeout(5)
connected = cross_process_sum()  # gloo connects
c.wait_at_barrier("breaker_connected", 30_000, [0, 1])
if me == 0:
    c.key_value_set("test/breaker/entering", "1")
    t0 = time.monotonic()
    try:
        ended = f"completed: {cross_process_sum()}"
    except Exception as e:  # noqa: BLE001 - the broken all-reduce, what the test looks at
        ended = str(e).splitlines()[0]
    rt.events.log("breaker", ended=ended, seconds=round(time.monotonic() - t0, 3))
else:
    c.blocking_key_value_get("test/breaker/entering", 30_000)
    time.sleep(0.3)  # process 0 waits in the all-reduce for this process
    broke = breaker.break_data_plane()
    rt.events.log("breaker", broke=broke, own_connection=round_trip(mine, accepted))
c.wait_at_barrier("breaker_done", 30_000, [0, 1])

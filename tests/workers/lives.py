"""Test worker: a barrier set up by a member map gives up on a member whose life in it ended.

Run by tests/test_deaths.py under ``jaxft launch -n 2``; argv[1] is the signal process 0 may
use: ``records`` (the launcher's death records), ``retired`` (the life record the launcher
wrote as it retired the dead life; the records hidden, as on another node), ``restart`` (the
restart's new life; the records hidden), ``heartbeat`` (none of these: the dead life's
heartbeat, whose nonce only its registration tells). Process 1's first life registers, agrees
a member map with process 0 and SIGKILLs itself before reaching the barrier (the rebuild hole:
the barrier never learns its nonce from an arrival); in ``heartbeat`` mode it stops itself
instead (SIGSTOP: no launcher sees a death, as when a host dies) and process 0 kills it once
its barrier ended. Process 0 waits in a :class:`jaxft.worker.kv.KVBarrier` over that map
and logs a ``barrier`` event saying how it ended; a later life of process 1 registers,
waits for that event's key and exits 0.
"""

import os
import signal
import sys
import time

import jaxft

rt = jaxft.initialize()

import jax

from jaxft import protocol
from jaxft.errors import BarrierAbandoned, BarrierTimeout
from jaxft.worker import kv, lives

mode = sys.argv[1]
me = jax.process_index()
c = kv.client()
life = lives.register()
if me == 1 and life.launch != 0:
    c.blocking_key_value_get("test/done", 120_000)
    sys.exit(0)
live = {int(p): int(i) for p, i in c.get_live_nodes([0, 1]).items()}
assert live[me] == life.incarnation, (live, life)  # what member maps hold is what a life registers
if me == 1:
    if mode == "heartbeat":
        c.key_value_set("test/pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGKILL)
if mode != "records":
    os.environ.pop(protocol.FAULT_STATE_DIR, None)
if mode == "restart":  # (the retired record comes first: wait until the restart's own replaced it)
    deadline = time.monotonic() + 60
    while (now := lives.current(c, 1)) is None or now.retired or now.launch != 1:
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
timeouts = rt.timeouts.replace(save_dead_after=2.0 if mode == "heartbeat" else 60.0, reset=30.0)
barrier = kv.KVBarrier("test/rebuild", [0, 1], 0, timeouts=timeouts, lives=live,
                       options=kv.BarrierOptions(what="reset", dead_after="save_dead_after", unknown_after="reset",
                                                 timeout_name="reset"))
t0 = time.monotonic()
try:
    barrier(key="rebuild", timeout_ms=30_000)
    outcome = "passed"
except (BarrierAbandoned, BarrierTimeout) as e:
    outcome = f"{type(e).__name__}: {e}"
rt.events.log("barrier", mode=mode, outcome=outcome, seconds=round(time.monotonic() - t0, 3))
if mode == "heartbeat":
    os.kill(int(c.blocking_key_value_get("test/pid", 10_000)), signal.SIGKILL)
c.key_value_set("test/done", "1")

"""Test worker: a ready key whose process's newest life was retired is not voted, on any node.

Run by tests/test_spares.py under ``jaxft launch -n 2``. Process 1 registers its life and
announces itself ready (as a waiting spare does), waits until process 0's ready watcher voted
it, then SIGKILLs itself: its key stays in the service. The launcher retires its life and
writes so in its life record. Process 0's watcher is given no death records (as on another
node, whose launcher's records it cannot read); it logs a ``stale_ready`` event with its vote
for process 1 before the death and once the record is retired, and whether the key was still
there.
"""

import os
import signal
import time

import jaxft

rt = jaxft.initialize()

import jax

from jaxft.worker import admission, kv, lives

me = jax.process_index()
c = kv.client()
if me == 1:
    lives.register()
    c.key_value_set(f"{admission.READY_PREFIX}1/test", f"{time.time():.6f}")
    c.blocking_key_value_get("test/voted", 60_000)
    # The launcher's retire helper imports jaxlib beside the workers' start-ups; a death before
    # it is up (plus its 1 s bound) is left to the heartbeat (a retire_failed event), not what
    # this test is about: die well after the start.
    time.sleep(max(0.0, 4.0 - (time.time() - lives.process_started_at())))
    os.kill(os.getpid(), signal.SIGKILL)
watcher = admission.ReadyWatcher(2, dict, poll_s=0.05)


def vote() -> int:
    return int(watcher.votes([0])[1])


deadline = time.monotonic() + 60
while vote() == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
before = vote()
c.key_value_set("test/voted", "1")
while not ((life := lives.current(c, 1)) and life.retired) and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.3)  # (a few of the watcher's polls)
after = vote()
keys = [k for k, _ in c.key_value_dir_get(admission.READY_PREFIX)]
rt.events.log("stale_ready", before=before, after=after, retired=bool(life and life.retired), keys=keys)
watcher.stop()

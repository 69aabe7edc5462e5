"""Test worker: every member of one key-value barrier gets the same outcome.

Run by tests/test_kv_barrier.py under ``jaxft launch -n 2``. Process 1 arrives at a
:class:`jaxft.worker.kv.KVBarrier` and then gives up (its ``cancel`` is set from a thread once its
arrival key is in the store, as when a death is recorded); process 0 arrives only after that
(once process 1's ``abandoned`` marker is written), so it finds every arrival key present.
Then both pass a barrier of a fresh namespace, and process 0 removes both namespaces' keys.
Each process logs a ``barrier`` event: the first barrier's outcome, what the second one's
decision key held, and which keys were left after the housekeeping.
"""

import threading

import jaxft

rt = jaxft.initialize()

import jax

from jaxft.errors import BarrierAbandoned, BarrierTimeout
from jaxft.worker import kv

SPLIT, PASSING = "test/agree", "test/agree-pass"
me = jax.process_index()
c = kv.client()
timeouts = rt.timeouts.replace(save_dead_after=60.0, reset=30.0)


def barrier(namespace: str, cancel: threading.Event | None = None) -> kv.KVBarrier:
    return kv.KVBarrier(namespace, [0, 1], me, cancel, timeouts=timeouts,
                        options=kv.BarrierOptions(what="reset", dead_after="save_dead_after", unknown_after="reset",
                                                  timeout_name="reset"))


def outcome(b: kv.KVBarrier) -> str:
    try:
        b(key="rebuild", timeout_ms=30_000)
        return "passed"
    except (BarrierAbandoned, BarrierTimeout) as e:
        return f"{type(e).__name__}: {e}"


cancel = threading.Event()
if me == 1:
    def give_up_once_arrived() -> None:
        c.blocking_key_value_get(f"{SPLIT}/rebuild/0/1", 30_000)
        cancel.set()

    threading.Thread(target=give_up_once_arrived, daemon=True).start()
else:
    c.blocking_key_value_get(f"{SPLIT}/abandoned/1", 30_000)
split = barrier(SPLIT, cancel)
first = outcome(split)
passing = barrier(PASSING)
second = outcome(passing)
decision = kv.try_get(f"{PASSING}/rebuild/0/decision")
c.wait_at_barrier("test_agree_read", 30_000, [0, 1])
left: list[str] = []
if me == 0:
    split.delete_keys()
    passing.delete_keys()
    left = sorted(k for ns in (SPLIT, PASSING) for k, _ in c.key_value_dir_get(f"{ns}/"))
rt.events.log("barrier", outcome=first, second=second, decision=decision, left=left)
c.wait_at_barrier("test_agree_done", 30_000, [0, 1])

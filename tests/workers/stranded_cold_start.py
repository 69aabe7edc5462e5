"""Test worker: the mlp (:mod:`jaxft.bench.mlp`, same flags) in a cold start whose first query
an earlier life of process 3 entered, so that process 3's restart is named in an answer it
never got (tests/test_admission.py; :mod:`jaxft.core.coldstart`). Four processes; each step
of the story waits for the one before, none for a fixed time:

1. the first lives of processes 1 and 3 enter the cold start's first query over all four
   and SIGKILL themselves 0.3 s after asking (their entries stay in the service's query);
2. processes 0 and 2 wait, before their first step, until process 3's restart has connected;
3. 3's restart, once connected, waits until 0 and 2 confirm the service's answer (which
   named it) before it sets up, then marks ``<state dir>/confirmed``;
4. 1's restart waits for that mark before it connects, so the answer left it out.
"""

import os
import signal
import threading
import time

from absl import app

import jaxft
from jaxft import protocol
from jaxft.bench.mlp import main
from jaxft.worker import coldstart, deaths, kv

ME = (int(os.environ[protocol.PROCESS_ID]), int(os.environ.get(protocol.INCARNATION, "0")))
MARK = os.path.join(os.environ[protocol.FAULT_STATE_DIR], "confirmed")
CONNECTED = "jaxft/test/connected/3"


def wait(ready, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {ME}: waited {timeout_s} s for {what}")
        time.sleep(0.05)


def confirmed() -> bool:
    try:
        return bool(kv.client().key_value_dir_get(coldstart.CONFIRM_PREFIX))
    except Exception:  # noqa: BLE001 - NOT_FOUND on some versions
        return False


initialize = jaxft.initialize


def story_initialize(*args, **kwargs):
    if ME == (1, 1):
        wait(lambda: os.path.exists(MARK), "process 3's restart to see the confirmations")
    rt = initialize(*args, **kwargs)
    if ME == (3, 1):
        kv.client().key_value_set(CONNECTED, "1", allow_overwrite=True)
        wait(confirmed, "processes 0 and 2 to confirm")
        open(MARK, "w").close()
    if ME in ((0, 0), (2, 0)):
        import jax

        jax.devices()  # (every first life's CPU backend waits for the others' in the service)
        wait(lambda: kv.try_get(CONNECTED) is not None, "process 3's restart to connect")
    return rt


jaxft.initialize = story_initialize

if ME in ((1, 0), (3, 0)):
    ask = deaths._ask

    def ask_then_die(query, pids):
        future = ask(query, pids)
        if sorted(pids) == [0, 1, 2, 3]:  # (in the query 0.3 s later: the service has it)
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return future

    deaths._ask = ask_then_die

if __name__ == "__main__":
    app.run(main)

"""Test worker: the mlp (:mod:`jaxft.bench.mlp`, same flags) in a run whose last member dies while
the restarts of the others wait to be admitted (tests/test_admission.py). Four processes; each
step of the story waits for the one before, none for a fixed time:

1. the test's faults kill 0 and 3, then 1: process 2 enters its next step alone, and writes a
   members record (over 2 alone) newer than the lives of 0's and 3's restarts;
2. process 2's first life, once it committed a step alone, SIGKILLs itself before the first
   step it starts after a restart said it is ready (before it could admit one): nobody is left
   to admit them, every process starts cold;
3. process 2's restart connects only once 1's restart has confirmed a cold start's answer that
   left 2 out (it marks ``<state dir>/confirmed-by-1``), so that the others start without it.
"""

import os
import signal
import time

from absl import app

import jaxft
from jaxft import protocol
from jaxft.bench.mlp import main
from jaxft.worker import admission, coldstart, kv
from jaxft.worker.loop import ElasticLoop

ME = (int(os.environ[protocol.PROCESS_ID]), int(os.environ.get(protocol.INCARNATION, "0")))
MARK = os.path.join(os.environ[protocol.FAULT_STATE_DIR], "confirmed-by-1")

if ME == (2, 0):
    try_step = ElasticLoop.try_step
    alone = []  # (a step it committed alone: only then a restart's readiness ends it; a restart of
    # 0 or 3 ready before 1 died would otherwise end it before it ever ran alone)

    def die_once_one_is_ready(self):
        if alone and kv.try_dir_get(admission.READY_PREFIX):
            os.kill(os.getpid(), signal.SIGKILL)
        record = try_step(self)
        if record is not None and tuple(record.members) == (2,):
            alone.append(record.step)
        return record

    ElasticLoop.try_step = die_once_one_is_ready

if ME == (1, 1):
    publish_confirm = coldstart.publish_confirm

    def confirm_and_mark(pids, writer):
        publish_confirm(pids, writer)
        open(MARK, "w").close()

    coldstart.publish_confirm = confirm_and_mark

if ME == (2, 1):
    initialize = jaxft.initialize

    def initialize_once_1_confirmed(*args, **kwargs):
        deadline = time.monotonic() + 120.0
        while not os.path.exists(MARK):
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {ME}: 1's restart never confirmed a cold start's answer")
            time.sleep(0.05)
        return initialize(*args, **kwargs)

    jaxft.initialize = initialize_once_1_confirmed

if __name__ == "__main__":
    app.run(main)

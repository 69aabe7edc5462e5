"""Test worker: the mlp (:mod:`jaxft.bench.mlp`, same flags) in a run where a member is named in
a step's entry answer it never got (tests/test_admission.py; :func:`jaxft.core.coldstart.entered_with`).
Three processes; the faults (the test's) and this worker make the story, none of it timed:

1. process 1 is killed after its gradient: 0 and 2, in the step's exit query over all three,
   find its death record and ask again over (0, 2). They leave the query over all three open in
   the service, each counted in;
2. process 2 is killed at the next step: its entry in that open query stays (the service counts
   entrants by process id, not by life);
3. the restarts of 1 and 2 are admitted. When the members ask over all three again, the ask of
   whichever comes first with 0's completes that open query (2 counted in by its earlier life),
   and the answer names 2's new life;
4. here 2's restart sends its first ask over all three only once a members record over the three
   is written in its life, that is once the others entered the step with it: that ask opens a
   new query, where nobody else will ever ask.
"""

import json
import os
import time

from absl import app

from jaxft import protocol
from jaxft.bench.mlp import main
from jaxft.worker import admission, deaths, kv

ME = (int(os.environ[protocol.PROCESS_ID]), int(os.environ.get(protocol.INCARNATION, "0")))
STARTED = time.time()


def entered_without_me() -> bool:
    for _, value in kv.try_dir_get(f"{admission.MEMBERS_KEY}/"):
        record = json.loads(value)
        if record["pids"] == [0, 1, 2] and record["time"] > STARTED:
            return True
    return False


if ME[0] == 2 and ME[1] >= 1:
    ask = deaths._ask
    first = [True]

    def ask_once_they_entered(query, pids):
        if sorted(pids) != [0, 1, 2] or not first[0]:
            return ask(query, pids)
        first[0] = False

        def late(pids):  # (in the query thread: the main thread goes on watching the records)
            deadline = time.monotonic() + 120.0
            while not entered_without_me():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"process {ME}: the others never entered the step over [0, 1, 2]")
                time.sleep(0.05)
            return query(pids)

        return ask(late, pids)

    deaths._ask = ask_once_they_entered

if __name__ == "__main__":
    app.run(main)

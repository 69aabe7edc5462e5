"""A worker whose first life fails and whose second writes what it found (tests/test_standby.py).

``standby_probe.py OUT``, process 0 (process 1 waits for OUT): life 0 exits 3 (a crash before
any commit) once a standby is ready (or after ``$PROBE_HOLD_S``); life 1 writes to OUT as
JSON its pid, argv, ``__name__``, per-life environment, whether jax was imported before this
module ran (a standby imports it while it waits) and whether its stdin is at its end, then exits 0.
"""

import glob
import json
import os
import sys
import time

JAX_BEFORE = "jax" in sys.modules  # (nothing above imports it)


def main() -> None:
    if os.environ["JAXFT_PROCESS_ID"] != "0":  # a peer that runs on (a standby serves only then)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not os.path.exists(sys.argv[1]):
            time.sleep(0.05)
        return
    if os.environ["JAXFT_INCARNATION"] == "0":
        time.sleep(1.5)  # (a peer counts as running on only if it ran 1 s before this death)
        # the launcher's standby ready (its imports done) before this life dies, or a hold
        state_dir = os.environ["JAXFT_FAULT_STATE_DIR"]
        deadline = time.monotonic() + float(os.environ.get("PROBE_HOLD_S", "30"))
        while time.monotonic() < deadline and not glob.glob(os.path.join(state_dir, "standby-*.ready")):
            time.sleep(0.05)
        sys.exit(3)
    found = {
        "pid": os.getpid(), "argv": sys.argv, "name": __name__, "jax_before": JAX_BEFORE,
        "stdin_at_end": sys.stdin.read() == "",
        "env": {k: os.environ.get(k) for k in ("JAXFT_PROCESS_ID", "JAXFT_INCARNATION", "JAXFT_LIFE_STARTED",
                                               "JAXFT_PREVIOUS_DIED_AT")},
    }
    with open(sys.argv[1], "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    main()

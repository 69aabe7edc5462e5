"""Names of the environment variables the launcher hands to each worker.

One place for the contract between :mod:`jaxft.launcher` (writer) and
:mod:`jaxft.runtime`, :mod:`jaxft.faults`, :mod:`jaxft.events` (readers).
"""

from typing import Mapping

COORDINATOR = "JAXFT_COORDINATOR_ADDRESS"  # host:port of the coordination service
EXTERNAL_COORDINATOR = "JAXFT_EXTERNAL_COORDINATOR"  # "1": no worker hosts the service
PROCESS_ID = "JAXFT_PROCESS_ID"
NUM_PROCESSES = "JAXFT_NUM_PROCESSES"
LOCAL_DEVICE_IDS = "JAXFT_LOCAL_DEVICE_IDS"  # comma separated, e.g. "0" or "2,3"
HEARTBEAT_TIMEOUT = "JAXFT_HEARTBEAT_TIMEOUT"  # seconds
COLLECTIVE_TIMEOUT = "JAXFT_COLLECTIVE_TIMEOUT"  # seconds, CPU collectives
INCARNATION = "JAXFT_INCARNATION"  # 0 for the first start, +1 per restart
DIED_AT = "JAXFT_PREVIOUS_DIED_AT"  # wall-clock time the launcher saw the previous incarnation exit
# A restart: "1" when a member may still run (a local worker whose life began before the death,
# or other nodes), "0" when every local worker is down or a restart of the same failure
PEERS_RUNNING = "JAXFT_PEERS_MAY_RUN"
RUN_DIR = "JAXFT_RUN_DIR"
FAULTS = "JAXFT_FAULTS"  # ";"-separated fault specs (see jaxft.faults)
FAULT_STATE_DIR = "JAXFT_FAULT_STATE_DIR"  # where "rule fired" markers live

TIMEOUTS = "JAXFT_TIMEOUTS"  # "name=seconds,..." (see jaxft.timeouts.Timeouts)
GLOO_INTERFACE = "JAXFT_GLOO_INTERFACE"  # network interface CPU collectives (gloo) use, e.g. "eth0"
GLOO_HOSTNAME = "JAXFT_GLOO_HOSTNAME"  # or the hostname/address gloo advertises
CHECKPOINT_ON_STOP = "JAXFT_CHECKPOINT_ON_STOP"  # "1": on SIGTERM, agree on a step, save, then exit
# Read by the launcher itself: "0" stops it from retiring a dead worker's life in the service
# (jaxft._compat.retire_life), as happens where it cannot (another node's agent died with it):
# for tests of the members' own guard, the step votes
RETIRE_LIVES = "JAXFT_RETIRE_LIVES"


def peers_may_run(environ: Mapping[str, str]) -> bool | None:
    """The launcher's word on a restart (:data:`PEERS_RUNNING`): a member may run on (True),
    none does (False), or nothing said (None: a first life, or no jaxft launch)."""
    return {"1": True, "0": False}.get(environ.get(PEERS_RUNNING, ""))

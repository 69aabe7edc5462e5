"""Where a worker's identity comes from: arguments, ``jaxft launch``, ``JAX_*`` variables or
the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU), and the checks that keep a
misconfigured job from silently training alone.

:func:`resolve` fills coordinator address, process count, process id and local device ids
from, in order: the arguments and the ``JAXFT_*`` environment ``jaxft launch`` sets, the
explicit ``JAX_*`` variables ``jax.distributed.initialize`` honours, and jax's own cluster
detection (through :func:`jaxft._compat.detect_cluster`). Only when nothing at all
describes a job does it answer "single process". An environment that half describes a
cluster (``SLURM_NTASKS=2`` without a node list, say) is an error, never a lone run.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from jaxft import _compat, protocol
from jaxft.errors import InitializeError
from jaxft.net import is_loopback

SOURCES = ("jaxft-launch", "explicit", "slurm", "ompi", "k8s", "tpu", "single-process")

# The variables jax's SLURM detection needs (all five), and those that say "this is a SLURM step".
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
OMPI_URI = "OMPI_MCA_orte_hnp_uri"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Who this worker is in which job, and where that was read."""

    source: str  # one of SOURCES
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: list[int] | None
    external_coordinator: bool  # no worker hosts the coordination service

    @property
    def single_process(self) -> bool:
        return self.source == "single-process"


def parse_env(value, name: str, parse):
    """``parse(value)`` of environment variable ``name``; None if unset or empty."""
    if value is None or value == "":
        return None
    try:
        return parse(value)
    except ValueError:
        raise InitializeError(f"environment variable {name}={value!r} is malformed") from None


def parse_ids(raw: str) -> list[int]:
    return [int(x) for x in raw.split(",") if x.strip()]


def resolve(coordinator_address: str | None, num_processes: int | None, process_id: int | None,
            local_device_ids: Sequence[int] | None, external_coordinator: bool | None,
            initialization_timeout: float, environ: Mapping[str, str] = os.environ) -> Placement:
    """The :class:`Placement` of this worker (see the module docstring for the order)."""
    given_args = any(v is not None for v in (coordinator_address, num_processes, process_id, local_device_ids))
    from_jaxft_env = coordinator_address is None and bool(environ.get(protocol.COORDINATOR))
    fields: dict[str, Any] = {
        "coordinator_address": coordinator_address if coordinator_address is not None
        else parse_env(environ.get(protocol.COORDINATOR), protocol.COORDINATOR, str),
        "num_processes": num_processes if num_processes is not None
        else parse_env(environ.get(protocol.NUM_PROCESSES), protocol.NUM_PROCESSES, int),
        "process_id": process_id if process_id is not None
        else parse_env(environ.get(protocol.PROCESS_ID), protocol.PROCESS_ID, int),
        "local_device_ids": list(local_device_ids) if local_device_ids is not None
        else parse_env(environ.get(protocol.LOCAL_DEVICE_IDS), protocol.LOCAL_DEVICE_IDS, parse_ids),
    }
    if environ.get(protocol.PROCESS_ID):
        source = "jaxft-launch"
    elif given_args:
        source = "explicit"
    else:
        source = None

    def missing() -> bool:
        return any(fields[k] is None for k in ("coordinator_address", "num_processes", "process_id"))

    if missing():  # the variables jax.distributed.initialize reads itself
        jax_env = {"coordinator_address": ("JAX_COORDINATOR_ADDRESS", str), "num_processes": ("JAX_NUM_PROCESSES", int),
                   "process_id": ("JAX_PROCESS_ID", int), "local_device_ids": ("JAX_LOCAL_DEVICE_IDS", parse_ids)}
        for key, (name, parse) in jax_env.items():
            if fields[key] is None and environ.get(name):
                fields[key] = parse_env(environ[name], name, parse)
                source = source or "explicit"
    if missing() and environ is os.environ:  # jax's detection reads the process environment
        found = _compat.detect_cluster(max(1, int(initialization_timeout)))
        if found is not None:
            name, *values = found
            for key, value in zip(("coordinator_address", "num_processes", "process_id", "local_device_ids"), values):
                if fields[key] is None:
                    fields[key] = value
            source = {"gke_tpu": "tpu", "gce_tpu": "tpu"}.get(name, name)
    if (fields["coordinator_address"] is None and fields["num_processes"] in (None, 1)
            and fields["process_id"] in (None, 0)):
        if fields["num_processes"] is None:  # an explicit 1 is a deliberate single-process run
            check_no_partial_cluster(environ)
        return Placement("single-process", None, 1, 0, fields["local_device_ids"], True)
    if missing():
        raise InitializeError(
            "jaxft.initialize needs coordinator_address, num_processes and process_id, as arguments, from "
            "the environment jaxft launch sets, from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / "
            "JAX_PROCESS_ID, or from a cluster jax detects (missing: "
            + ", ".join(k for k in ("coordinator_address", "num_processes", "process_id") if fields[k] is None) + ")")
    if external_coordinator is None:
        flag = environ.get(protocol.EXTERNAL_COORDINATOR)
        # An address from JAXFT_COORDINATOR_ADDRESS names a `jaxft coordinator` (or a launcher's).
        external_coordinator = flag == "1" if flag else from_jaxft_env
    return Placement(source or "explicit", fields["coordinator_address"], fields["num_processes"],
                     fields["process_id"], fields["local_device_ids"], bool(external_coordinator))


def check_no_partial_cluster(environ: Mapping[str, str]) -> None:
    """Raise when the environment half describes a multi-process job jax cannot detect."""
    present = [v for v in SLURM_VARS if environ.get(v)]
    if any(environ.get(v) for v in ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEP_NODELIST")) \
            and len(present) < len(SLURM_VARS) and environ.get("SLURM_NTASKS", "2") != "1":
        absent = [v for v in SLURM_VARS if v not in present]
        raise InitializeError(
            f"this looks like a SLURM job step of {environ.get('SLURM_NTASKS', 'several')} tasks, but "
            f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not set, so jax cannot find its peers; "
            "each task would train alone. Start the tasks with srun (which sets them), or set "
            "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, or use jaxft launch.")
    size = environ.get("OMPI_COMM_WORLD_SIZE")
    if size and size != "1" and not environ.get(OMPI_URI):
        raise InitializeError(
            f"this looks like an Open MPI job of {size} ranks, but {OMPI_URI} is not set, so jax cannot find "
            "its peers; each rank would train alone. Set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
            "JAX_PROCESS_ID, or use jaxft launch.")
    if environ.get("JOB_COMPLETION_INDEX") and environ.get("KUBERNETES_SERVICE_HOST"):
        raise InitializeError(
            "this looks like a Kubernetes indexed Job, but jax's Kubernetes detection is not available "
            "(it needs the `kubernetes` package and a service account); set JAX_COORDINATOR_ADDRESS, "
            "JAX_NUM_PROCESSES and JAX_PROCESS_ID, or run jaxft launch in each pod (examples/cluster/jobset.yaml).")


# -- the address CPU collectives advertise -------------------------------------------------------

def check_gloo_reachable(coordinator_address: str, num_processes: int, environ: Mapping[str, str]) -> None:
    """Fail early when gloo would advertise a loopback address to peers on other hosts.

    gloo (jax's CPU collectives) advertises the address this host's name resolves to. With
    the coordinator on another host and the name mapped to 127.x (the default of many
    containers), peers would time out connecting to each other; say why and how to fix it.
    Only for CPU runs: GPU collectives do not go through gloo.
    """
    if num_processes < 2:
        return
    platforms = environ.get("JAX_PLATFORMS", "")
    cpu_run = platforms.split(",")[0] == "cpu" if platforms else shutil.which("nvidia-smi") is None
    host = coordinator_address.rpartition(":")[0]
    if not cpu_run or is_loopback(host):
        return
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return
    if is_loopback(address):
        raise InitializeError(
            f"this host's name {name!r} resolves to {address} (loopback), and the coordinator {coordinator_address} "
            "is on another host: CPU collectives (gloo) would advertise the loopback address and peers could not "
            "connect. Fix: name the network interface gloo should use (jaxft launch --gloo-interface IFACE, "
            f"{protocol.GLOO_INTERFACE}=IFACE, or jaxft.initialize(options=InitOptions(gloo_interface=...))), "
            f"or map {name!r} to this "
            "host's address in /etc/hosts.")

"""A real SLURM cluster on one machine, for the scheduler tests (``tests/test_slurm.py``).

slurmctld runs in the root namespace on the bridge's address; every node is a network
namespace of :mod:`netns` with its own IP and its own slurmd; munged runs once (its socket
is a file every namespace reaches). Jobs are submitted with the real ``sbatch`` and run
their tasks in their nodes' namespaces. Debian's ``slurm-wlm`` and ``munge`` are installed
with apt where missing (root only); without root, apt or the packages the tests skip with the
reason. :meth:`SlurmCluster.close` stops every daemon it started and removes the
namespaces, also when a test fails. How it is brought up, and the traps (``nsenter``, not
``ip netns exec``; a hosts file per node), are in ``../shared/notes/slurm-facts.md``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from helpers import wait_for
from netns import Hosts, require_root

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol")


def _have_slurm() -> bool:
    return all(shutil.which(d) or os.path.exists(f"/usr/sbin/{d}") for d in DAEMONS)


def require_slurm() -> None:
    """Install slurm-wlm and munge with apt where missing; skip (with the reason) where that cannot be done."""
    require_root()
    if _have_slurm():
        return
    if not shutil.which("apt-get"):
        pytest.skip("a real SLURM cluster needs slurm-wlm and munge (no apt-get here to install them)")
    r = subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], capture_output=True, text=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, timeout=900)
    if r.returncode != 0 or not _have_slurm():
        pytest.skip(f"could not install {' '.join(PACKAGES)} with apt: {(r.stderr or r.stdout).strip()[-300:]}")


def _conf(h: Hosts, names: Sequence[str], d: Path, ctld_port: int, slurmd_port: int) -> str:
    nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs=8 State=UNKNOWN" for n, a in zip(names, h.addresses))
    return f"""ClusterName=jaxft{os.getpid() % 10000}
SlurmctldHost={os.uname().nodename}({h.gateway})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=30
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/jobcomp.log
SlurmdTimeout=15
MessageTimeout=5
KillWait=5
SchedulerParameters=sched_interval=5
MinJobAge=3600
ReturnToService=2
InactiveLimit=0
MpiDefault=none
{nodes}
PartitionName=jx Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """slurmctld and ``n`` slurmd nodes (``names``); clients use ``env`` (``SLURM_CONF``)."""

    def __init__(self, n: int, workdir: Path):
        self.h = Hosts(n)
        tag = os.getpid() % 10000
        self.names = [f"jx{tag}n{i}" for i in range(n)]
        self.dir = workdir
        self.conf = workdir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._ctld: subprocess.Popen | None = None
        self._slurmd: dict[int, subprocess.Popen] = {}
        self._munged = False

    # -- bring up / tear down -------------------------------------------------------------
    def open(self) -> SlurmCluster:
        self.h.open()
        try:
            (self.dir / "state").mkdir(parents=True, exist_ok=True)
            base = 17000 + (os.getpid() % 1000) * 2
            self.conf.write_text(_conf(self.h, self.names, self.dir, base, base + 1))
            for i, a in enumerate(self.h.addresses):  # each node's /etc/hosts: every node, and "us" = this node
                lines = ["127.0.0.1 localhost", *(f"{b} {n}" for b, n in zip(self.h.addresses, self.names)),
                         f"{a} {os.uname().nodename}"]
                (self.dir / f"hosts-{i}").write_text("\n".join(lines) + "\n")
            self._start_munged()
            self._ctld = subprocess.Popen(["slurmctld", "-D", "-c", "-i", "-f", str(self.conf)], env=self.env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd=self.dir)  # a core file lands there
            for i in range(len(self.names)):
                self.start_slurmd(i)
            try:
                wait_for(lambda: all(self.node_state(n).split("+")[0] in ("IDLE", "MIXED", "ALLOCATED")
                                     for n in self.names), 60, interval=0.5, what="every node up")
            except AssertionError as e:
                raise AssertionError(f"{e}\n{self.describe()}") from None
        except BaseException:
            self.close()
            raise
        return self

    def _start_munged(self) -> None:
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
            return  # one is running (ours from a previous session, or the machine's): it serves every namespace
        os.makedirs("/run/munge", exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True, capture_output=True)
        self._munged = True

    def start_slurmd(self, i: int) -> None:
        """Node ``i``'s slurmd, in its namespace, with its own /etc/hosts (a private mount namespace)."""
        inner = f"mount --bind {self.dir}/hosts-{i} /etc/hosts && exec slurmd -D -N {self.names[i]} -f {self.conf}"
        self._slurmd[i] = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.h.names[i]}", "unshare", "-m", "--propagation", "private",
             "sh", "-c", inner], env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=self.dir)

    def kill_node(self, i: int) -> list[int]:
        """SIGKILL node ``i`` whole: its slurmd and every process in its namespace."""
        pids = self.h.kill(i)
        if i in self._slurmd:
            self._slurmd.pop(i).wait(timeout=10)
        return pids

    def close(self) -> None:
        for p in [*self._slurmd.values(), self._ctld]:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*self._slurmd.values(), self._ctld]:
            if p is not None:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._slurmd.clear()
        self._ctld = None
        self.h.close()  # every process left in a node, then the namespaces and the bridge
        if self._munged:
            subprocess.run(["pkill", "-x", "munged"], check=False)
            self._munged = False

    # -- clients ------------------------------------------------------------------------------
    def run(self, *args: str, check: bool = True, timeout: float = 30) -> str:
        r = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def node_state(self, name: str) -> str:
        out = self.run("scontrol", "show", "node", name, "-o", check=False)
        m = re.search(r"\bState=(\S+)", out)
        return m.group(1) if m else "UNKNOWN"

    def sbatch(self, script: str | Path, *options: str, args: Sequence[str] = (), env: dict[str, str] | None = None,
               cwd: Path | None = None) -> int:
        """Submit ``script args`` with sbatch ``options``; the job id."""
        r = subprocess.run(["sbatch", "--parsable", *options, str(script), *map(str, args)],
                           env={**self.env, **(env or {})},
                           capture_output=True, text=True, timeout=30, cwd=cwd)
        if r.returncode != 0:
            raise AssertionError(f"sbatch: exit {r.returncode}: {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", str(job_id), "-o", check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def job_state(self, job_id: int) -> str:
        return self.job(job_id).get("JobState", "UNKNOWN")

    def wait_job(self, job_id: int, timeout: float) -> str:
        """The job's final state (COMPLETED, FAILED, ...), waiting at most ``timeout`` s."""
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                 "DEADLINE", "PREEMPTED")
        wait_for(lambda: self.job_state(job_id) in ended, timeout, interval=1.0,
                 what=f"job {job_id} to end (state {self.job_state(job_id)})")
        return self.job_state(job_id)

    def steps(self, job_id: int) -> list[str]:
        """The job's steps SLURM still counts as running (``squeue -s``)."""
        out = self.run("squeue", "-h", "-s", "-j", str(job_id), "-o", "%i %j", check=False)
        return [line for line in out.splitlines() if line.strip()]

    def describe(self) -> str:
        out = []
        for log in sorted(self.dir.glob("*.log")):
            out.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-2000:]}")
        return "\n".join(out)


@contextlib.contextmanager
def slurm_cluster(n: int, workdir: Path) -> Iterator[SlurmCluster]:
    """A cluster of ``n`` nodes, torn down on exit."""
    require_slurm()
    c = SlurmCluster(n, workdir).open()
    try:
        yield c
    finally:
        c.close()

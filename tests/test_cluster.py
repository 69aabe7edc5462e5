"""Cluster-aware initialize: settings from a (fake) SLURM step, JAX_* variables, and clear
errors for environments that half describe a job. Real processes, real coordination service."""

import json
import subprocess
import time
from collections.abc import Callable

import pytest
from helpers import PYTHON, REPO, clean_env, free_port, run_python

pytestmark = pytest.mark.smoke  # jax's cluster detection is private API: check it on every jax

SUM = """
import json, sys
import jaxft
rt = jaxft.initialize(timeouts=jaxft.Timeouts.from_env().replace(initialization=30))
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devices = sorted(jax.devices(), key=lambda d: d.id)
mesh = Mesh(devices, ("x",))
mine = [jax.device_put(np.full((1,), rt.process_id + 1.0, np.float32), d) for d in devices
        if d.process_index == rt.process_id]
x = jax.make_array_from_single_device_arrays((len(devices),), NamedSharding(mesh, P("x")), mine)
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
print(json.dumps({"source": rt.source, "n": rt.num_processes, "pid": rt.process_id,
                  "external": rt.external_coordinator, "sum": float(np.asarray(total.addressable_data(0)))}),
      flush=True)

"""


def _two(env_of, code: str = SUM) -> list[dict]:
    procs = [subprocess.Popen([PYTHON, "-c", code], env=env_of(i), cwd=REPO, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, f"returncode {p.returncode}\n{out}\n{err[-4000:]}"
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def test_fake_slurm_step_of_two_tasks():
    port = str(free_port())

    def env(i):
        return clean_env(SLURM_JOB_ID="1234", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                         SLURM_PROCID=str(i), SLURM_LOCALID=str(i), JAX_COORDINATOR_PORT=port)

    outs = _two(env)
    assert [o["pid"] for o in outs] == [0, 1]
    for o in outs:
        assert o["source"] == "slurm" and o["n"] == 2, o
        assert o["external"] is False, o  # process 0 hosts the service, as in plain JAX
        assert o["sum"] == 3.0, o  # 1 + 2: both processes took part


def _explicit_env() -> Callable[[int], dict]:
    """Process ``i``'s environment for a two-process job described by JAX_* variables."""
    port = free_port()
    return lambda i: clean_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                               JAX_PROCESS_ID=str(i))


def test_explicit_jax_variables():
    outs = _two(_explicit_env())
    assert [(o["source"], o["n"], o["pid"], o["sum"]) for o in outs] == [("explicit", 2, 0, 3.0),
                                                                           ("explicit", 2, 1, 3.0)]


# Process 1 is slow to leave: atexit runs handlers last-in first-out, so a handler registered
# after jax's import and before initialize() runs between jaxft's exit announcement and jax's
# own shutdown. Process 0 hosts the service and must outlive that, or process 1's ShutdownTask
# finds no service and aborts (SIGABRT).
SLOW_EXIT = """
import atexit, os, time
import jax
if os.environ["JAX_PROCESS_ID"] == "1":
    atexit.register(time.sleep, 2.0)
""" + SUM


def test_process_0_outlives_a_peer_that_is_slow_to_exit():
    assert [o["sum"] for o in _two(_explicit_env(), SLOW_EXIT)] == [3.0, 3.0]


@pytest.mark.parametrize("drop", ["SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID"])
def test_incomplete_slurm_step_is_a_clear_error(drop):
    env = dict(SLURM_JOB_ID="1234", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2", SLURM_PROCID="1",
               SLURM_LOCALID="1")
    env.pop(drop)
    code = ("import jaxft\ntry:\n    jaxft.initialize()\nexcept jaxft.InitializeError as e:\n"
            "    print('InitializeError:', e)\nelse:\n    print('initialized alone')\n")
    t0 = time.monotonic()
    r = run_python(code, timeout=30, env=clean_env(**env))
    assert time.monotonic() - t0 < 10, r.describe()
    assert r.returncode == 0, r.describe()
    assert "InitializeError: this looks like a SLURM job step of 2 tasks" in r.stdout, r.describe()
    assert f"{drop} is not set" in r.stdout and "srun" in r.stdout, r.describe()


def test_open_mpi_without_its_uri_is_a_clear_error():
    code = ("import jaxft\ntry:\n    jaxft.initialize()\nexcept jaxft.InitializeError as e:\n"
            "    print('InitializeError:', e)\n")
    r = run_python(code, timeout=30, env=clean_env(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="1"))
    assert "InitializeError: this looks like an Open MPI job of 4 ranks" in r.stdout, r.describe()


def test_plain_process_is_single_process():
    code = "import jaxft\nrt = jaxft.initialize()\nprint(rt.source, rt.num_processes, rt.process_id)\n"
    r = run_python(code, timeout=60, env=clean_env())
    assert r.returncode == 0, r.describe()
    assert r.stdout.strip().splitlines()[-1] == "single-process 1 0", r.describe()

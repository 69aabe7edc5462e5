"""The private jax/jaxlib API jaxft is pinned to (see the jax bound in pyproject.toml).

Every borrowed name lives in the ``jaxft._compat`` package; these tests check that the names are
there *and* that each shim function still does what jaxft relies on, with real processes.
Each check fails with a message that names the moved piece: when one fails on a new jax
release, jaxft must be adapted before that release is allowed by pyproject's bound.
"""

import importlib
import inspect
import json
import sys

import jax
import pytest
from helpers import REPO, by_event, clean_env, events, free_port, launch, run_python

pytestmark = pytest.mark.smoke

MOVED = (f"jaxft's pinned private jax API moved in jax {jax.__version__}: {{what}}. jaxft must be "
         "adapted (or the jax upper bound in pyproject.toml lowered) before supporting this release.")


def moved(what: str) -> str:
    return MOVED.format(what=what)


def _get(path: str):
    """Import ``a.b.c:attr.sub`` style paths; pytest.fail with the MOVED message if absent."""
    module_name, _, attrs = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        pytest.fail(moved(f"module {module_name} cannot be imported ({e})"))
    for attr in filter(None, attrs.split(".")):
        if not hasattr(obj, attr):
            pytest.fail(moved(f"{path} is missing ({attr!r} not found)"))
        obj = getattr(obj, attr)
    return obj


def _parameters(fn, what: str) -> set[str] | None:
    """``fn``'s parameter names; None when it only shows ``*args, **kwargs`` (a wrapper)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # nanobind functions: parse the documented signature
        doc = (fn.__doc__ or "").splitlines()
        if not doc:
            pytest.fail(moved(f"cannot read the signature of {what}"))
        head = doc[0]
        inner = head[head.index("(") + 1:head.rindex(")")] if "(" in head else ""
        names = set()
        depth = 0
        token = ""
        for ch in inner + ",":
            if ch in "[(":
                depth += 1
            elif ch in "])":
                depth -= 1
            if ch == "," and depth == 0:
                names.add(token.split(":")[0].split("=")[0].strip())
                token = ""
            else:
                token += ch
        return names
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if all(p.kind in variadic for p in params.values()):
        return None
    return set(params)


def test_service_factory_accepts_recoverable():
    """The names where the signature shows them (jax 0.11.2's shows only ``*args, **kwargs``,
    seen on the GPU machine), and in any case the call jaxft makes: a recoverable service
    that a jax client connects to."""
    from jaxft import _compat

    fn = _get("jax._src.lib:_jax.get_distributed_runtime_service")
    params = _parameters(fn, "jax._src.lib._jax.get_distributed_runtime_service")
    for name in ("address", "num_nodes", "heartbeat_timeout", "shutdown_timeout", "recoverable"):
        assert params is None or name in params, moved(
            f"jax._src.lib._jax.get_distributed_runtime_service no longer takes {name}= "
            f"(parameters now: {sorted(params)})")
    address = f"127.0.0.1:{free_port()}"
    try:
        service = _compat.start_service(address, 1, heartbeat_timeout=3, shutdown_timeout=1)
    except TypeError as e:
        pytest.fail(moved(f"jax._src.lib._jax.get_distributed_runtime_service rejects jaxft's call ({e})"))
    try:
        r = run_python(f"""
import jax
jax.config.update("jax_enable_recoverability", True)
jax.distributed.initialize({address!r}, num_processes=1, process_id=0, initialization_timeout=20)
from jax._src.distributed import global_state
global_state.client.key_value_set("probe", "ok")
print("GOT", global_state.client.blocking_key_value_get("probe", 5000))
jax.distributed.shutdown()
""", timeout=60)
        assert r.returncode == 0 and "GOT ok" in r.stdout, r.describe()
    finally:
        service.shutdown()


def test_distributed_global_state():
    distributed = _get("jax._src.distributed")
    state = _get("jax._src.distributed:global_state")
    for attr in ("client", "service"):
        assert hasattr(state, attr), moved(f"jax._src.distributed.global_state has no .{attr}")
    assert hasattr(distributed, "_jax"), moved(
        "jax._src.distributed no longer has the module attribute _jax (jaxft swaps it to keep "
        "process 0 from starting a second coordination service)")
    assert hasattr(distributed._jax, "get_distributed_runtime_service"), moved(
        "jax._src.distributed._jax.get_distributed_runtime_service is gone")
    assert hasattr(distributed._jax, "get_distributed_runtime_client"), moved(
        "jax._src.distributed._jax.get_distributed_runtime_client is gone")


def test_backend_hooks():
    fn = _get("jax._src.xla_bridge:backends_are_initialized")
    assert callable(fn), moved("jax._src.xla_bridge.backends_are_initialized is not callable")
    clear = _get("jax.extend.backend:clear_backends")
    assert callable(clear), moved("jax.extend.backend.clear_backends is not callable")


def test_live_devices_and_process_failure_error():
    live = _get("jax.experimental.multihost_utils:live_devices")
    assert hasattr(live, "devices"), moved(
        "jax.experimental.multihost_utils.live_devices has no .devices (jaxft re-keys it after "
        "a CPU backend rebuild)")
    assert callable(live), moved("jax.experimental.multihost_utils.live_devices is not callable")
    error_cls = _get("jax.experimental.multihost_utils:ProcessFailureError")
    assert issubclass(error_cls, Exception)
    try:
        error = error_cls(failed_devices=set())
    except TypeError as e:
        pytest.fail(moved(f"ProcessFailureError(failed_devices=...) no longer works ({e})"))
    assert hasattr(error, "failed_devices"), moved("ProcessFailureError has no .failed_devices")


CLIENT_METHODS = ("get_live_nodes", "key_value_delete", "key_value_set", "key_value_try_get",
                  "wait_at_barrier")


@pytest.mark.parametrize("method", CLIENT_METHODS)
def test_client_methods_exist(method):
    client_cls = _get("jax._src.lib:_jax.DistributedRuntimeClient")
    assert hasattr(client_cls, method), moved(f"DistributedRuntimeClient.{method} is gone")


def test_key_value_set_allows_overwrite():
    fn = _get("jax._src.lib:_jax.DistributedRuntimeClient.key_value_set")
    params = _parameters(fn, "DistributedRuntimeClient.key_value_set")
    assert "allow_overwrite" in params, moved("key_value_set no longer takes allow_overwrite=")
    barrier = _get("jax._src.lib:_jax.DistributedRuntimeClient.wait_at_barrier")
    assert "process_ids" in _parameters(barrier, "wait_at_barrier"), moved(
        "wait_at_barrier no longer takes process_ids=")


def test_service_and_client_work_together():
    """Not just present: a recoverable service and a client really talk (fresh process)."""
    code = """
import json, socket
from jax._src.lib import _jax
from jaxft import _compat
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
address = f"127.0.0.1:{port}"
service = _compat.start_service(address, 1, heartbeat_timeout=3, shutdown_timeout=5)
client = _jax.get_distributed_runtime_client(address, 0, init_timeout=20, heartbeat_timeout=3,
                                             use_compression=True)
client.connect()
out = {}
client.key_value_set("jaxft/k", "v1")
client.key_value_set("jaxft/k", "v2", allow_overwrite=True)
out["get"] = client.key_value_try_get("jaxft/k")
client.key_value_delete("jaxft/k")
try:
    out["after_delete"] = client.key_value_try_get("jaxft/k")
except Exception as e:  # NOT_FOUND is raised, not returned
    out["after_delete"] = "raised " + type(e).__name__
client.key_value_delete("jaxft/absent")  # deleting a missing key is fine
out["create"] = [_compat.create_key(client, "jaxft/c", "first"), _compat.create_key(client, "jaxft/c", "second"),
                 client.key_value_try_get("jaxft/c")]
out["live"] = {str(k): v for k, v in client.get_live_nodes([0]).items()}
client.wait_at_barrier("jaxft_test_barrier", 5000, [0])
print(json.dumps(out), flush=True)
client.shutdown()
service.shutdown()
"""
    r = run_python(code, timeout=60)
    assert r.returncode == 0, moved("a recoverable service plus client no longer work as jaxft uses "
                                    "them") + "\n" + r.describe()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["get"] == "v2", moved(f"key_value_set/try_get changed: {out}")
    assert out["after_delete"].startswith("raised"), moved(f"key_value_try_get on a missing key: {out}")
    assert out["create"] == [True, False, "first"], moved(f"key_value_set(allow_overwrite=False) of an existing "
                                                          f"key no longer raises ALREADY_EXISTS: {out}")
    assert list(out["live"]) == ["0"], moved(f"get_live_nodes returned {out['live']}")
    assert isinstance(out["live"]["0"], int), moved(f"get_live_nodes values are not incarnations: {out}")


RETIRE = """
import functools, json, socket, sys, threading
from jaxft import _compat
from jaxft.supervisor import retire
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
address = f"127.0.0.1:{port}"
service = _compat.start_service(address, 2, heartbeat_timeout=10, shutdown_timeout=5)
make = _compat.client_factory()
clients = [make(address, p, init_timeout=20, heartbeat_timeout=10) for p in (0, 1)]
threads = [threading.Thread(target=c.connect) for c in clients]  # (registration waits for both)
[t.start() for t in threads]
[t.join() for t in threads]
before = clients[0].get_live_nodes([0])[0], clients[1].get_live_nodes([1])[1]
if sys.argv[1] == "helper":  # through the launcher's helper process
    r = retire.Retirer(address)
    r.start()
    r._ready.wait(60)
    said = r.retire(1, 7, 30.0)
    r.close()
else:
    _compat.retire_life(address, 1, then=functools.partial(retire.record_retired, 1, 7))
    said = "done 1"
# the old life of 1 asks too (as a member that entered a query before dying would have)
threading.Thread(target=clients[1].get_live_nodes, args=([0, 1],), daemon=True).start()
after = {str(k): int(v) for k, v in clients[0].get_live_nodes([0, 1]).items()}
record = json.loads(clients[0].key_value_try_get("jaxft/life/1"))
print(json.dumps({"before": [int(x) for x in before], "after": after, "said": said, "record": record}), flush=True)
import os
os._exit(0)
"""


@pytest.mark.parametrize("how", ["in-process", "helper"])
def test_a_retired_life_is_named_with_a_new_incarnation(how):
    """``retire_life`` registers a new incarnation of a live process at once: every later
    liveness answer names it (what makes a member late to a query see the dead life gone), and
    its ``then`` acts as that incarnation (it records it as the process's retired life)."""
    r = run_python(RETIRE, how, timeout=120)
    assert r.returncode == 0, moved("a client connecting as another process no longer registers it") + r.describe()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["said"] == "done 1", out
    assert out["after"]["0"] == out["before"][0], moved(f"the other process's incarnation changed: {out}")
    assert out["after"]["1"] != out["before"][1], moved(f"retire_life did not change the incarnation: {out}")
    # the new incarnation is written as 1's life record, marked retired, for other nodes' members
    assert out["record"] == {"incarnation": out["after"]["1"], "nonce": "", "launch": 7, "retired": True}, out


def test_backend_started_tracks_the_backend():
    code = """
import json
from jaxft import _compat
before = _compat.backend_started()
import jax
jax.devices()
print(json.dumps([before, _compat.backend_started()]))
"""
    r = run_python(code, timeout=60)
    assert r.returncode == 0, r.describe()
    assert r.stdout.strip().splitlines()[-1] == "[false, true]", moved(
        "jax._src.xla_bridge.backends_are_initialized no longer reports the backend state") + r.describe()


def test_no_service_start_keeps_process_0_a_plain_client():
    """With an external service, process 0 connects without starting a second one."""
    code = """
import json
from jax._src import distributed
from jaxft import _compat
from jaxft.coordinator import Coordinator
coord = Coordinator(1)
real = distributed._jax
with _compat.no_service_start():
    import jax
    jax.distributed.initialize(coord.address, 1, 0, initialization_timeout=20)
out = {"service": distributed.global_state.service is None, "restored": distributed._jax is real,
       "client": _compat.distributed_client() is not None}
_compat.distributed_client().key_value_set("jaxft/x", "1")
out["kv"] = _compat.distributed_client().key_value_try_get("jaxft/x")
print(json.dumps(out), flush=True)
jax.distributed.shutdown()
coord.shutdown()
"""
    r = run_python(code, timeout=60)
    assert r.returncode == 0, moved("jax.distributed.initialize with the service factory swapped fails") + \
        "\n" + r.describe()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"service": True, "restored": True, "client": True, "kv": "1"}, moved(
        f"jax._src.distributed._jax / global_state changed: {out}")


def test_distributed_client_before_initialize_is_a_clear_error():
    code = """
from jaxft import _compat
from jaxft.errors import InitializeError
assert _compat.distributed_client_or_none() is None
try:
    _compat.distributed_client()
except InitializeError as e:
    print("raised:", e)
"""
    r = run_python(code, timeout=30)
    assert r.returncode == 0, r.describe()
    assert "raised: jax.distributed is not initialized" in r.stdout, r.describe()


def test_cpu_rendezvous_keys_and_live_devices_state(tmp_path):
    """Two real processes: the gloo and topology keys jaxft deletes exist under those names and
    vanish; gloo's loop watches its connections level-triggered beside its listener;
    live_devices' remembered map holds incarnations; after a backend rebuild with the map
    re-keyed, the processes agree and compute again (what a CPU rejoin relies on)."""
    r = launch(2, [sys.executable, str(REPO / "tests" / "workers" / "private_keys.py")], run_dir=tmp_path,
               timeout=120)
    assert r.returncode == 0, r.describe()
    (out,) = by_event(events(tmp_path), "private_keys")
    assert out["gloo_keys_before"] > 0, moved(f"no key under {out!r}: the CPU backend's gloo rendezvous keys "
                                              "are no longer named cpu:gloo/...")
    assert out["topology_before"] is True, moved("the CPU backend's global topology key is no longer "
                                                 "cpu:global_topology/cpu")
    assert out["gloo_listener_advertised"] is True, moved(f"gloo's rendezvous records no longer advertise its "
                                                          f"listener as _compat.gloo_listen_address reads them: {out}")
    assert out["gloo_pairs_level_triggered"] and all(out["gloo_pairs_level_triggered"]), moved(
        f"gloo's event loop no longer watches its connections in an epoll instance beside its listener, "
        f"level-triggered, as jaxft.worker.deadpairs finds them: {out}")
    assert out["gloo_keys_after"] == 0 and out["topology_after"] is False, out
    assert [p for p, _ in out["live_map"]] == [0, 1], moved(f"live_devices.devices changed: {out['live_map']}")
    assert all(isinstance(i, int) for _, i in out["live_map"]), out
    assert out["rekeyed"] is True, moved("live_devices.devices can no longer be re-keyed")
    assert out["live_after"] == [0, 1], out
    assert out["sum_after"] == out["sum_before"], out


def test_gloo_interface_reregisters_the_cpu_backend(tmp_path):
    """_compat.use_gloo_address swaps the CPU backend factory (private xla_bridge) so gloo
    binds a named interface; two processes must still all-reduce through it, also after the
    data-plane rebuild that re-creates the backend from that factory."""
    from helpers import ALLREDUCE_WORKER

    r = launch(2, [sys.executable, str(ALLREDUCE_WORKER), "--seconds", "4"], "--gloo-interface", "lo",
               run_dir=tmp_path, timeout=120)
    assert r.returncode == 0, moved("the CPU backend factory can no longer be re-registered") + "\n" + r.describe()
    rounds = by_event(events(tmp_path), "allreduce")
    assert {tuple(e["members"]) for e in rounds} == {(0, 1)} and len(rounds) >= 4, r.describe()


def test_cpu_cache_entries_serve_every_process(tmp_path):
    # jax keys a cache entry by the devices' topology, whose CPU fingerprint differs per
    # process, and only process 0 writes: without jaxft._compat.share_cpu_cache_entries,
    # process 1 never loads the step it compiled the run before (it recompiles every mesh).
    _get("jax._src.cache_key:_hash_accelerator_config")
    _get("jax._src.cache_key:_hash_devices")
    cache = tmp_path / "cache"
    worker = [sys.executable, str(REPO / "tests" / "workers" / "cache_share.py"), str(cache)]
    runs = []
    for name in ("first", "second"):
        r = launch(2, worker, run_dir=tmp_path / name, timeout=120)
        assert r.returncode == 0, r.describe()
        runs.append({e["process"]: e for e in by_event(events(tmp_path / name), "cache")})
    first, second = runs
    assert sorted(second) == [0, 1], runs
    assert first[0]["value"] == first[1]["value"] == second[0]["value"] == second[1]["value"], runs
    assert first[1]["step_hits"] == 0, runs
    assert second[0]["step_hits"] == 1 and second[1]["step_hits"] == 1, moved(
        f"a CPU executable cached by process 0 is not loaded by process 1 ({runs})")
    # jax writes entries from process 0 only; a program on process 1's own device has a key
    # of its own: without jaxft._compat.cache_local_executables process 1 compiles it in every life
    _get("jax._src.compiler:compile_or_get_cached")
    _get("jax._src.compiler:_cache_write")
    _get("jax._src.compilation_cache:put_executable_and_time")
    assert first[0]["own_value"] == second[1]["own_value"] == second[0]["own_value"], runs
    assert first[0]["own_hits"] == first[1]["own_hits"] == 0, runs
    assert second[0]["own_hits"] == 1 and second[1]["own_hits"] == 1, moved(
        f"process 1 does not load the program on its own device that it cached the run before ({runs})")


def test_an_executable_serialized_by_process_0_runs_in_process_1(tmp_path):
    # jaxft.worker.executables shares step programs: process 0 compiles, the others load its
    # bytes. On jax 0.12.1 such a program hangs or times out in its first all-reduce (measured:
    # docs/benchmarks.md, 'Figures behind the code'), which is why pyproject's bound stops below it.
    worker = [sys.executable, str(REPO / "tests" / "workers" / "program_share.py"), str(tmp_path / "program.pkl")]
    r = launch(2, worker, run_dir=tmp_path / "run", timeout=120)
    assert r.returncode == 0, moved("a multi-process CPU executable serialized by process 0 no longer runs in "
                                    "process 1") + "\n" + r.describe()
    totals = {e["process"]: e["total"] for e in by_event(events(tmp_path / "run"), "program_share")}
    assert totals == {0: [1.0, 3.0, 5.0, 7.0], 1: [1.0, 3.0, 5.0, 7.0]}, totals


SERIALIZED = r'''
import jax, numpy as np
import jax.extend.backend as jax_backend
from jaxft import _compat
f = jax.jit(lambda x, y: (x @ y).sum(0))
x, y = np.arange(12.0, dtype=np.float32).reshape(3, 4), np.ones((4, 2), np.float32)
compiled = f.lower(x, y).compile()
before = np.asarray(compiled(x, y))
blob = _compat.serialize_compiled(compiled)
client = jax.devices()[0].client
jax_backend.clear_backends()
loaded = _compat.load_compiled(blob, jax.devices()[:1])
assert jax.devices()[0].client is not client, "the backend was not rebuilt"
print("same", np.array_equal(np.asarray(loaded(x, y)), before))
'''


def test_a_serialized_executable_loads_into_a_rebuilt_backend():
    # jaxft.worker.executables keeps step programs as bytes across the CPU backend rebuild of a rejoin
    _get("jax.experimental.serialize_executable:serialize")
    _get("jax.experimental.serialize_executable:deserialize_and_load")
    r = run_python(SERIALIZED, timeout=120)
    assert r.returncode == 0, moved(f"a serialized executable no longer loads into a new backend: {r.describe()}")
    assert "same True" in r.stdout, moved(r.describe())


REASSIGNED = r"""
import jax, numpy as np
import jax.extend.backend as jax_backend
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxft import _compat

def program(ids):
    mesh = Mesh(np.array([jax.devices()[i] for i in ids]), ("data",))
    f = jax.jit(lambda x: (x * 2.0).sum(0),  # a sum over the sharded axis: a collective
                in_shardings=NamedSharding(mesh, P("data")), out_shardings=NamedSharding(mesh, P()))
    x = jax.device_put(np.arange(12.0, dtype=np.float32).reshape(3, 4) / 7, NamedSharding(mesh, P("data")))
    return f.lower(x), x

lowered_a, _ = program((1, 2, 3))
lowered_b, xb = program((0, 2, 3))
assert lowered_a.as_text() == lowered_b.as_text(), "the same module for both device lists"
blob = _compat.serialize_compiled(lowered_a.compile())
direct = np.asarray(lowered_b.compile()(xb))
jax_backend.clear_backends()
_, xb = program((0, 2, 3))
loaded = _compat.load_compiled(blob, [jax.devices()[i] for i in (0, 2, 3)], compiled_for=(1, 2, 3))
out = loaded(xb)
print("devices", sorted(s.device.id for s in out.addressable_shards))
print("same", np.asarray(out).tobytes() == direct.tobytes())
"""


def test_a_serialized_executable_loads_for_other_devices():
    # jaxft.worker.executables compiles one program per mesh width and signature: a program for
    # devices (1, 2, 3) runs on (0, 2, 3) with its device assignment replaced
    _get("jax.experimental.serialize_executable:_JaxPjrtUnpickler")
    _get("jax._src.compiler:get_compile_options")
    r = run_python(REASSIGNED, timeout=120, env=clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=4"))
    assert r.returncode == 0, moved(f"an executable no longer loads for other devices: {r.describe()}")
    assert "devices [0, 2, 3]" in r.stdout and "same True" in r.stdout, moved(r.describe())


CACHE_HIT = r'''
import sys, jax, numpy as np
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from jaxft import _compat
_, fresh = _compat.compile_fresh(jax.jit(lambda x: (x * 3.0).sum()).lower(np.ones(7, np.float32)))
print("fresh", fresh)
'''


def test_a_persistent_cache_hit_is_seen(tmp_path):
    # jaxft.worker.executables keeps only freshly compiled programs (a cache-loaded CPU program
    # serialized again loses its kernels); the hit is seen through jax's monitoring event
    got = []
    for _ in range(2):
        r = run_python(CACHE_HIT, str(tmp_path / "cache"), timeout=120)
        assert r.returncode == 0, r.describe()
        got.append(r.stdout.split()[-1])
    assert got == ["True", "False"], moved(f"the persistent cache's hit event is not seen ({got})")

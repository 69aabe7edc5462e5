"""Borrowed compiler internals: the persistent compilation cache across processes, and
compiled programs carried across backends."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


# -- the persistent compilation cache across processes -------------------------------------------

def share_cpu_cache_entries() -> None:
    """Give a multi-process CPU executable the same persistent-cache key in every process.

    jax keys a cache entry partly by the topology of the devices it runs on
    (``jax._src.cache_key._hash_accelerator_config``); a CPU topology's fingerprint differs
    from process to process (it describes the caller's own devices), and only process 0
    writes entries. So processes other than 0, a restarted process included, never found
    an entry and recompiled every mesh (measured: docs/benchmarks.md, 'Figures behind the
    code'). On CPU, hash the device kinds instead (what jax does for backends without a
    topology): the program, the device assignment (in the compile options) and the flags
    still key the entry, and an
    executable compiled by process 0 loads in every process (jax's own
    ``jax_share_binary_between_hosts`` relies on the same). Idempotent; other platforms are
    untouched.
    """
    import numpy as np
    from jax._src import cache_key

    original = cache_key._hash_accelerator_config
    if getattr(original, "_jaxft_cpu_shared", False):
        return

    def hash_accelerator_config(hash_obj, accelerators, *args, **kwargs):
        devices = list(np.asarray(accelerators).flat)
        if devices and all(getattr(d, "platform", None) == "cpu" for d in devices):
            cache_key._hash_devices(hash_obj, np.asarray(accelerators))
            return None
        return original(hash_obj, accelerators, *args, **kwargs)

    hash_accelerator_config._jaxft_cpu_shared = True  # type: ignore[attr-defined]
    cache_key._hash_accelerator_config = hash_accelerator_config


def cache_local_executables() -> None:
    """Let every process write the persistent-cache entries of programs that run on its own
    devices only.

    jax writes cache entries from process 0 alone (``compiler._cache_write``: many writers of
    one key contend on shared filesystems). That is right for a multi-process executable
    (every process has the same key, and :func:`share_cpu_cache_entries` makes process 0's
    entry serve them all), but a program on one process's own devices (a model's ``init``,
    a host-side helper) has a key of its own per process (its device assignment): no
    process but 0 ever found one, and each restarted process compiled them again, holding up
    a cold restart of the whole run (measured: docs/benchmarks.md, 'Figures behind the
    code'). Such entries are now written by their process (one writer per key: no
    contention); every other entry is left to jax. Idempotent.

    Private: ``jax._src.compiler.compile_or_get_cached`` (wrapped to see the devices) and
    ``_cache_write`` (replaced for such programs by ``compilation_cache.put_executable_and_time``,
    under jax's own callback and compile-time rules). Upstream could key the process-0 rule
    on whether the executable spans processes.
    """
    import threading

    import jax
    import numpy as np
    from jax._src import compilation_cache, compiler, distributed

    if getattr(compiler._cache_write, "_jaxft_local", False):
        return
    original_compile, original_write = compiler.compile_or_get_cached, compiler._cache_write
    local = threading.local()

    def compile_or_get_cached(backend, computation, devices, *args, **kwargs):
        me = distributed.global_state.process_id
        before = getattr(local, "own", False)
        local.own = bool(me) and all(d.process_index == me for d in np.asarray(devices).flat)
        try:
            return original_compile(backend, computation, devices, *args, **kwargs)
        finally:
            local.own = before

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, *rest, **kwargs):
        if not getattr(local, "own", False):
            return original_write(cache_key, compile_time_secs, module_name, backend, executable, *rest, **kwargs)
        host_callbacks = rest[0] if rest else kwargs.get("host_callbacks", ())
        if host_callbacks or compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
            return None  # (jax's own rules: callbacks are baked into the program; too quick to keep)
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as e:  # noqa: BLE001 - a cache is an optimisation, as in jax
            logger.warning("could not write the persistent cache entry of %r: %s", module_name, e)
        return None

    compile_or_get_cached._jaxft_local = True  # type: ignore[attr-defined]
    cache_write._jaxft_local = True  # type: ignore[attr-defined]
    compiler.compile_or_get_cached, compiler._cache_write = compile_or_get_cached, cache_write


# -- compiled programs across backends ----------------------------------------------------------

def serialize_compiled(compiled: Any) -> tuple:
    """``(bytes, in_tree, out_tree)`` of a ``jax.stages.Compiled``, loadable into a later backend.

    ``jax.experimental.serialize_executable`` (experimental: no stability promise; it reads
    the executable's private ``_unloaded_executable``). Devices are stored by id, so the bytes
    load into the backend a CPU rebuild makes, whose devices have the same ids.
    """
    from jax.experimental import serialize_executable

    return serialize_executable.serialize(compiled)


def load_compiled(blob: tuple, devices: Sequence[Any], compiled_for: Sequence[int] | None = None) -> Any:
    """:func:`serialize_compiled`'s bytes loaded into the current backend, to run on ``devices``
    (the program's device assignment, in its order: a mesh's devices; jax's default, every
    device of the backend, is wrong for a program over a subset of them).

    ``compiled_for``: the ids of the devices the program was compiled for, when they are not
    ``devices``' (as many): the program is loaded for ``devices`` instead, its device
    assignment replaced. Sound only for a program that lowers to the same module for both
    device lists (the caller checks); jax does the same with its persistent cache on GPU,
    whose entries are keyed without the device assignment and loaded with the caller's.

    Private (that case only): ``jax.experimental.serialize_executable._JaxPjrtUnpickler``
    (its device table remapped: the pickled shardings name devices by id) and
    ``jax._src.compiler.get_compile_options`` (the options jax compiles a 1-D SPMD program
    with, given the new assignment, passed to ``Client.deserialize_executable`` as jax's
    persistent cache does). No public API loads an executable for other devices.
    """
    import jax
    from jax.experimental import serialize_executable

    devices = list(devices)
    client = jax.devices()[0].client
    serialized, in_tree, out_tree = blob
    if compiled_for is None or [d.id for d in devices] == list(compiled_for):
        return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree, backend=client,
                                                         execution_devices=devices)
    if len(compiled_for) != len(devices):
        raise ValueError(f"a program for {len(compiled_for)} devices cannot run on {len(devices)}")
    import io

    import numpy as np
    from jax._src import compiler

    options = compiler.get_compile_options(num_replicas=1, num_partitions=len(devices),
                                           device_assignment=np.array(devices, dtype=object).reshape(1, -1),
                                           backend=client)

    class Reassigning(serialize_executable._JaxPjrtUnpickler):
        def __init__(self, file):
            super().__init__(file, client, devices)
            self.devices_by_id = dict(zip(compiled_for, devices))

        def persistent_load(self, pid):
            if pid[0] == "exec":
                return client.deserialize_executable(pid[1], executable_devices=self.execution_devices,
                                                     compile_options=options)
            return super().persistent_load(pid)

    unloaded, args_info_flat, no_kwargs = Reassigning(io.BytesIO(serialized)).load()
    return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info_flat), out_tree,
                               no_kwargs=no_kwargs)


_compile_hits = None  # a threading.local counting this thread's persistent-cache hits


def compile_fresh(lowered: Any) -> tuple[Any, bool]:
    """``lowered.compile()``, and whether the executable was compiled now rather than loaded from
    jax's persistent compilation cache.

    jaxft serializes only what was compiled now: a CPU executable loaded from the persistent
    cache and serialized again loses its kernels (the reloaded program fails with
    ``NOT_FOUND: Function ..._fusion not found``; measured: docs/benchmarks.md, 'Figures
    behind the code'). The hit is seen through jax's monitoring event
    ``/jax/compilation_cache/cache_hits`` (public listener API, event name not documented),
    counted per thread because the warm-up thread compiles too.
    """
    global _compile_hits
    import threading

    import jax

    if _compile_hits is None:
        _compile_hits = threading.local()

        def on_event(event: str, **_: str | int) -> None:
            if event == "/jax/compilation_cache/cache_hits":
                _compile_hits.n = getattr(_compile_hits, "n", 0) + 1

        jax.monitoring.register_event_listener(on_event)
    before = getattr(_compile_hits, "n", 0)
    compiled = lowered.compile()
    return compiled, getattr(_compile_hits, "n", 0) == before

"""Every private jax / jaxlib name jaxft borrows, in one place.

jaxft needs a few things upstream has no public API for yet. Each function here says
why it is needed and what would replace it. The supported jax range is pinned in
``pyproject.toml``; ``tests/test_private_api.py`` checks the *behaviour* of each one
(not only that the name exists), so a release that moves one fails loudly there.
(Orbax internals live in :mod:`jaxft.worker.checkpoint.orbax`, the only module touching them.)

Three modules by what they borrow: :mod:`~jaxft._compat.distributed` (the client, the
service, ``live_devices``' state, cluster detection), :mod:`~jaxft._compat.cpu` (the CPU
backend's gloo keys, address and event loop) and :mod:`~jaxft._compat.programs` (the compilation cache
and compiled programs). Import them through this package.
"""

from __future__ import annotations

from jaxft._compat.cpu import (
    EPOLLET,
    EPOLLIN,
    EPOLLONESHOT,
    GLOBAL_TOPOLOGY_KEY,
    GLOO_KEY_PREFIX,
    Registration,
    delete_global_topology_key,
    delete_stale_cpu_keys,
    disarm,
    epoll_registrations,
    gloo_listen_address,
    registrations_of,
    use_gloo_address,
)
from jaxft._compat.distributed import (
    backend_started,
    client_factory,
    create_key,
    detect_cluster,
    distributed_client,
    distributed_client_or_none,
    live_device_map,
    no_service_start,
    rekey_live_devices,
    retire_life,
    start_service,
)
from jaxft._compat.programs import (
    cache_local_executables,
    compile_fresh,
    load_compiled,
    serialize_compiled,
    share_cpu_cache_entries,
)

__all__ = [
    "EPOLLET", "EPOLLIN", "EPOLLONESHOT", "GLOBAL_TOPOLOGY_KEY", "GLOO_KEY_PREFIX", "Registration", "backend_started",
    "cache_local_executables", "client_factory", "compile_fresh", "create_key", "delete_global_topology_key",
    "delete_stale_cpu_keys", "detect_cluster", "disarm", "distributed_client", "distributed_client_or_none",
    "epoll_registrations", "gloo_listen_address", "live_device_map", "load_compiled", "no_service_start",
    "registrations_of", "rekey_live_devices", "retire_life", "serialize_compiled", "share_cpu_cache_entries",
    "start_service", "use_gloo_address",
]

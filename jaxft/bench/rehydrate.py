"""``jaxft bench rehydrate``: sending a state from a donor to a joiner over the live devices,
next to a plain TCP loopback copy of the same bytes (workers: ``python -m jaxft.bench.rehydrate``)."""

from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
import threading
import time

from jaxft.bench._jobs import launch, result
from jaxft.events import read_events
from jaxft.protocol import Event


def _socket_copy_s(nbytes: int) -> float:
    """Seconds to push ``nbytes`` through a loopback TCP connection (send + receive)."""
    payload = os.urandom(1 << 20) * max(1, nbytes >> 20)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send():
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(payload)

    t0 = time.perf_counter()
    thread = threading.Thread(target=send)
    thread.start()
    conn, _ = server.accept()
    buf = bytearray(len(payload))
    view, got = memoryview(buf), 0
    while got < len(payload):
        k = conn.recv_into(view[got:], min(1 << 22, len(payload) - got))
        if not k:
            break
        got += k
    thread.join()
    elapsed = time.perf_counter() - t0
    conn.close()
    server.close()
    return elapsed


def _rss_kib() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in KiB (Linux)."""
    with open("/proc/self/status") as f:
        d = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("VmRSS", "VmHWM"))}
    return d["VmRSS"], d["VmHWM"]


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (``clear_refs`` 5); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(mb: float) -> None:
    import jaxft

    rt = jaxft.initialize()
    import numpy as np

    from jaxft.worker import transfer

    n = int(mb * (1 << 20)) // 4
    tree = {"params": np.arange(n // 2, dtype=np.float32), "opt": np.arange(n - n // 2, dtype=np.int32)}
    if rt.process_id != 0:
        tree = {k: np.zeros_like(v) for k, v in tree.items()}
    group = jaxft.ElasticGroup()
    with group.step() as m:  # fresh processes: first step rebuilds the data plane
        pass
    times, extra = [], []
    nbytes = transfer.tree_nbytes(tree)
    for _ in range(3):
        with group.step() as m:
            got = None  # the previous round's result must not count as this round's baseline
            peak_ok = _reset_peak()
            rss0 = _rss_kib()[0]
            t0 = time.perf_counter()
            got = transfer.broadcast_tree(tree, 0, m.mesh)
            times.append(time.perf_counter() - t0)
            # Peak RSS over the transfer above the RSS before it, less the result's own leaves
            # (a receiver's new tree; the donor returns its own leaves): the transfer's overhead.
            result = 0 if rt.process_id == 0 else nbytes
            extra.append(max(0, (_rss_kib()[1] - rss0) * 1024 - result) if peak_ok else None)
    assert got is not None, "no round of the transfer completed"
    ok = all(np.array_equal(got[k], np.asarray(v) if rt.process_id == 0 else got[k]) for k, v in tree.items())
    ok = ok and bool(got["params"][-1] == np.float32(n // 2 - 1))
    role = "donor" if rt.process_id == 0 else "joiner" if rt.process_id == 1 else "bystander"
    rt.events.log(Event.BENCH_REHYDRATE_MEMORY, role=role,
                  rounds_mb=[None if e is None else round(e / 1e6, 1) for e in extra])
    sock = statistics.median(_socket_copy_s(nbytes) for _ in range(3)) if rt.process_id == 0 else 0.0
    t = statistics.median(times)
    rt.events.log(Event.BENCH_REHYDRATE, bytes=nbytes, seconds=round(t, 4), mb_per_s=round(nbytes / t / 1e6, 1),
                  socket_seconds=round(sock, 4), socket_mb_per_s=round(nbytes / sock / 1e6, 1) if sock else None,
                  ratio=round(t / sock, 2) if sock else None,
                  rate_ratio=round(sock / t, 2) if sock else None, correct=ok, processes=rt.num_processes)
    group.finish()


def bench_rehydrate(n: int = 2, mb: float = 100) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        launch(n, __name__, [str(mb)], run_dir)
        r = result(run_dir, "bench_rehydrate")
        memory: dict[str, dict] = {}
        for e in read_events(run_dir):
            if e["event"] == Event.BENCH_REHYDRATE_MEMORY:
                rounds = e["rounds_mb"]
                seen = memory.setdefault(e["role"], {"first": None, "warm": None})
                if None not in rounds:  # the largest over the processes of this role
                    seen["first"] = max(seen["first"] or 0.0, rounds[0])
                    seen["warm"] = max(seen["warm"] or 0.0, max(rounds[1:]))
    figures = {k: r[k] for k in ("bytes", "seconds", "mb_per_s", "socket_seconds", "socket_mb_per_s", "ratio",
                                 "rate_ratio", "correct", "processes")}
    # per role (donor, joiner, bystander with -n 3 or more): the first transfer (it compiles) and
    # the largest of the later ones
    figures["peak_extra_mb"] = {role: memory[role] for role in ("donor", "joiner", "bystander") if role in memory}
    return figures




if __name__ == "__main__":
    worker(float(sys.argv[1]))

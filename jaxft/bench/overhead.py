"""``jaxft bench overhead``: the atomic elastic step next to a plain multi-process JAX loop
with the same model, batch and mesh, and next to that plain loop plus one coordination-service
round trip per step (``get_live_nodes`` over every process, as the commit query): the floor of
a step that agrees on its commit through the service (workers: ``python -m jaxft.bench.overhead``)."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

from jaxft.bench._jobs import launch, result
from jaxft.errors import ConfigError
from jaxft.protocol import Event
from jaxft.worker.options import parse_commit_every

CHUNKS = 8  # the chunked reductions' chunk count in this bench


def worker(steps: int, hidden: int, batch: int, admission: str = "ready", reduction: str = "allreduce",
           pipeline: bool = False, commit_every: int | str = "auto") -> None:
    import jaxft

    rt = jaxft.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxft.worker import kv
    from jaxft.worker.arrays import replicate
    from jaxft.worker.data import shard_batch
    from jaxft.worker.train_step import make_train_step

    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(batch * 4, hidden)).astype(np.float32),
            "y": rng.normal(size=(batch * 4, 1)).astype(np.float32)}
    params = {"w1": (rng.normal(size=(hidden, hidden)) / np.sqrt(hidden)).astype(np.float32),
              "w2": (rng.normal(size=(hidden, hidden)) / np.sqrt(hidden)).astype(np.float32),
              "w3": (rng.normal(size=(hidden, 1)) / np.sqrt(hidden)).astype(np.float32)}

    def loss_fn(p, b):
        h = jnp.tanh(jnp.tanh(b["x"] @ p["w1"]) @ p["w2"])
        return jnp.sum((h @ p["w3"] - b["y"]) ** 2, axis=-1)

    tx = optax.sgd(1e-3)
    batches = jaxft.GlobalBatches(data, batch, seed=0)
    chunks = None if reduction == "allreduce" else CHUNKS
    trainer = jaxft.ElasticTrainer(loss_fn, tx, params, batches, runtime=rt,
                                   reduction=jaxft.Reduction(reduction, chunks=chunks),
                                   options=jaxft.LoopOptions(pipeline=pipeline, commit_every=commit_every,
                                                             admission=admission))
    trainer.group.begin_run(10 ** 9)  # (a step starts early only when the run's end is known)
    for _ in range(3):  # warm up: the first step rebuilds the data plane (and the backend) and compiles
        trainer.try_step()
    # The plain loop: the default all-reduce's step function (whatever ``reduction`` the
    # elastic step uses: its ratio includes the reduction's own cost), fixed mesh, state kept
    # as global arrays.
    mesh = trainer.group.mesh(sorted(jax.devices(), key=lambda d: d.id))
    fn = make_train_step(loss_fn, tx, batch, mesh)
    plain = {"p": replicate(params, mesh), "o": replicate(tx.init(params), mesh), "i": 0}

    def plain_step() -> None:
        b, m = shard_batch(batches.batch(plain["i"]), mesh)
        plain["p"], plain["o"], loss = fn(plain["p"], plain["o"], b, m)
        jax.block_until_ready(loss)
        plain["i"] += 1

    client, everyone = kv.client(), list(range(jax.process_count()))

    def floor_step() -> None:  # the plain step, then one round trip as the commit's
        plain_step()
        client.get_live_nodes(everyone)

    for _ in range(3):
        floor_step()
    # Interleaved in blocks of 10 steps, so that drift in the machine's load falls on all
    # alike (timed one after the other, the ratio moved from run to run by as much as the
    # overhead it measures: docs/benchmarks.md, 'Figures behind the code').
    # Timed by block: with pipeline a step's program runs on into the next call, and the
    # block ends when it has (settle), so each block holds its steps' whole time.
    blocks: dict[str, list[float]] = {"elastic": [], "plain": [], "floor": []}
    done = 0
    while done < steps:
        k = min(10, steps - done)
        for name, one in (("elastic", trainer.try_step), ("plain", plain_step), ("floor", floor_step)):
            t0 = time.perf_counter()
            for _ in range(k):
                one()
            if name == "elastic":
                trainer.settle()  # (before the plain loop runs programs on the same devices)
            blocks[name].append((time.perf_counter() - t0) / k)
        done += k
    del NamedSharding, P
    el, pl, fl = (statistics.median(blocks[name]) for name in ("elastic", "plain", "floor"))
    rt.events.log(Event.BENCH_OVERHEAD, elastic_ms=round(el * 1e3, 3), plain_ms=round(pl * 1e3, 3),
                  floor_ms=round(fl * 1e3, 3), ratio=round(el / pl, 4), floor_ratio=round(fl / pl, 4),
                  steps=steps, processes=rt.num_processes, hidden=hidden, global_batch=batch, reduction=reduction,
                  pipeline=pipeline, started_early=trainer.loop.executor.pipeline.started_early,
                  commit_every=commit_every,
                  deferred=trainer.group.deferred)
    trainer.group.finish()


def bench_overhead(n: int = 2, steps: int = 100, hidden: int = 512, batch: int = 512,
                   admission: str = "ready", reduction: str = "allreduce", pipeline: bool = False,
                   commit_every: int | str = "auto") -> dict:
    """``reduction`` other than the all-reduce cuts the batch in :data:`CHUNKS` chunks."""
    try:
        commit_every = parse_commit_every(commit_every)
    except ValueError:
        raise ConfigError(f"--commit-every must be auto or an int >= 1, got {commit_every}") from None
    if reduction != "allreduce" and batch % CHUNKS:
        raise ConfigError(f"--reduction {reduction} cuts the global batch in {CHUNKS} chunks: {batch} is not a "
                         "multiple of it")
    with tempfile.TemporaryDirectory() as run_dir:
        launch(n, __name__, [str(steps), str(hidden), str(batch), admission, reduction, str(int(pipeline)),
                      str(commit_every)],
               run_dir)
        r = result(run_dir, "bench_overhead")
    return {k: r[k] for k in ("elastic_ms", "plain_ms", "floor_ms", "ratio", "floor_ratio", "steps", "processes",
                              "hidden", "global_batch", "reduction", "pipeline", "started_early",
                              "commit_every", "deferred")}


def _main(argv: list[str]) -> None:
    """``python -m jaxft.bench.overhead STEPS HIDDEN BATCH [ADMISSION [REDUCTION [PIPELINE(0|1) [COMMIT_EVERY]]]]``
    (what :func:`bench_overhead` launches; an argument left out takes :func:`worker`'s default)."""
    a = argv[1:]
    worker(int(a[0]), int(a[1]), int(a[2]),
           admission=a[3] if len(a) > 3 else "ready",
           reduction=a[4] if len(a) > 4 else "allreduce",
           pipeline=bool(int(a[5])) if len(a) > 5 else False,
           commit_every=parse_commit_every(a[6]) if len(a) > 6 else "auto")


if __name__ == "__main__":
    _main(sys.argv)

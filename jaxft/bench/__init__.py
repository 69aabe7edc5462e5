"""``jaxft bench``: figures, never assertions.

* ``jaxft bench overhead -n 2``: per-step time of the atomic elastic step next to a plain
  multi-process JAX loop (:mod:`jaxft.bench.overhead`).
* ``jaxft bench rehydrate --mb 100``: state transfer to a joiner next to a TCP loopback
  copy (:mod:`jaxft.bench.rehydrate`).
* ``jaxft bench chaos -n 4``: goodput under failures, jaxft vs restart-all
  (:mod:`jaxft.bench.chaos`, workload :mod:`jaxft.bench.mlp`).
* ``jaxft bench kill -n 3 --phase in-step``: SIGKILL -> the survivors' next commit, and
  what a rejoin costs them (:mod:`jaxft.bench.kill`).
* ``jaxft bench checkpoint``: step-loop blocking of an async save vs a synchronous save
  (:mod:`jaxft.bench.checkpoint`).

Submodules import lazily, so ``jaxft --help`` does not load jax.
"""

from __future__ import annotations

import json

REDUCTIONS = ("allreduce", "allreduce64", "exact")  # jaxft.worker.options.REDUCTIONS (the CLI imports no worker code)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print figures")
    which = p.add_subparsers(dest="bench", required=True)
    o = which.add_parser("overhead", help="atomic elastic step vs a plain multi-process loop")
    o.add_argument("-n", type=int, default=2)
    o.add_argument("--steps", type=int, default=100)
    o.add_argument("--hidden", type=int, default=512)
    o.add_argument("--global-batch", type=int, default=512)
    o.add_argument("--admission", choices=("ready", "connect"), default="ready",
                   help="the elastic step's admission mode (jaxft.ElasticGroup)")
    o.add_argument("--reduction", choices=REDUCTIONS, default="allreduce",
                   help="the elastic step's reduction (jaxft.ElasticTrainer; the chunked ones in 8 chunks); the "
                        "plain loop always runs the all-reduce")
    o.add_argument("--pipeline", action="store_true",
                   help="start each step's program before the previous step's commit query (jaxft.ElasticLoop)")
    o.add_argument("--commit-every", default="auto",
                   help="one commit query per this many steps, or auto (default; jaxft.ElasticLoop's commit_every)")
    r = which.add_parser("rehydrate", help="state transfer to a joiner vs a TCP loopback copy")
    r.add_argument("-n", type=int, default=2)
    r.add_argument("--mb", type=float, default=100)
    c = which.add_parser("chaos", help="goodput under failures: jaxft vs restart-all-from-checkpoint")
    c.add_argument("-n", type=int, default=4)
    c.add_argument("--steps", type=int, default=300)
    c.add_argument("--kills", type=int, default=5, help="kills spread evenly over the run")
    c.add_argument("--kill-every", type=float, default=None, help="seconds between kills (instead of --kills)")
    c.add_argument("--admission", choices=("ready", "connect"), default="ready",
                   help="how the jaxft run admits restarted processes")
    c.add_argument("--precompile", type=int, default=8,
                   help="the jaxft runs' --precompile (process 0 compiles the member sets one failure "
                   "away in the background, jaxft.worker.warmup); 0: off")
    c.add_argument("--reduction", choices=REDUCTIONS, default="allreduce",
                   help="the three runs' gradient reduction (jaxft.ElasticTrainer; the chunked ones in 8 "
                   "chunks): allreduce64 makes the jaxft run's params bitwise equal to the fault-free run's")
    c.add_argument("--pipeline", action="store_true",
                   help="the three runs (and the overhead bench) with mlp --pipeline (jaxft.ElasticLoop)")
    c.add_argument("--spares", type=int, default=0, metavar="K",
                   help="also a jaxft run with K hot spares (jaxft launch --spares), the same kills")
    c.add_argument("--commit-every", default="auto",
                   help="the three runs (and the overhead bench) with one commit query per this many steps, or "
                        "auto (default; jaxft.ElasticLoop's commit_every; a number must divide --checkpoint-every)")
    c.add_argument("--checkpoint-every", type=int, default=20)
    c.add_argument("--step-sleep", type=float, default=0.1, help="stretch each step by this many seconds")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--keep-dirs", default=None, help="keep the run directories under this path")
    c.add_argument("--no-overhead", action="store_true", help="skip the per-step overhead measurement")
    x = which.add_parser("kill", help="SIGKILL -> the survivors' next commit; a rejoin's cost to them")
    x.add_argument("-n", type=int, default=3)
    x.add_argument("--phase", default="in-step", help="fault phase: in-step (inside the all-reduce), "
                   "before-step (between steps), after-grad, ...")
    x.add_argument("--kills", type=int, default=5)
    x.add_argument("--every", type=int, default=100, help="steps between kills")
    x.add_argument("--step-sleep", type=float, default=0.1)
    x.add_argument("--heartbeat", type=int, default=3)
    x.add_argument("--admission", choices=("ready", "connect"), default="ready")
    x.add_argument("--run-dir", default=None)
    k = which.add_parser("checkpoint", help="async save blocking time vs a synchronous save")
    k.add_argument("--mb", type=float, default=100, help="state size in MB")
    k.add_argument("--repeats", type=int, default=3)
    k.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    for q in (o, r, c, x, k):
        q.add_argument("--json", default=None, help="also write the figures to this file")


def run(args) -> int:
    if args.bench == "overhead":
        from jaxft.bench.overhead import bench_overhead

        figures = bench_overhead(args.n, args.steps, args.hidden, args.global_batch, args.admission,
                                 args.reduction, args.pipeline, args.commit_every)
        every = figures["commit_every"]
        print(f"per step: elastic {figures['elastic_ms']:.2f} ms, plain {figures['plain_ms']:.2f} ms, "
              f"ratio {figures['ratio']:.3f} ({figures['processes']} processes, {figures['reduction']}"
              f"{', pipeline' if figures['pipeline'] else ''}{_batching(every, figures['deferred'])})")
        print(f"floor (plain + one coordination-service round trip per step): {figures['floor_ms']:.2f} ms, "
              f"ratio {figures['floor_ratio']:.3f}")
    elif args.bench == "chaos":
        from jaxft.bench.chaos import Schedule, Workload, bench_chaos

        workload = Workload(args.steps, args.step_sleep, args.checkpoint_every, args.reduction, args.pipeline,
                            args.commit_every)
        figures = bench_chaos(args.n, workload, Schedule(args.kill_every, args.kills, args.seed),
                              admission=args.admission, precompile=args.precompile, keep_dirs=args.keep_dirs,
                              overhead=not args.no_overhead, spares=args.spares)
        print(f"{'':12s} {'goodput':>8s} {'steps lost':>10s} {'recovery s':>10s} {'train s':>8s} "
              f"{'max stall s':>11s} {'min width':>9s}  params vs fault-free")
        for name in ("fault_free", "jaxft", "restart_all", *(["jaxft_spares"] if args.spares else [])):
            f = figures[name]
            d = f.get("params_vs_fault_free")
            vs = "" if d is None else "bitwise" if d["bitwise_equal"] else f"{d['max_rel_diff_per_leaf']:.2e} rel"
            print(f"{name:12s} {f['goodput']:8.3f} {f['steps_lost']:10d} {str(f['recovery_s']):>10s} "
                  f"{f['train_s']:8.1f} {f['max_stall_s']:11.2f} {f['min_width']:9d}  {vs}"
                  + ("" if f["finals_agree"] else "  (processes disagree!)"))
        print(f"{len(figures['schedule'])} kills; checkpoint every {args.checkpoint_every} steps; "
              f"jaxft admission: {args.admission}, precompile: {args.precompile}; reduction: {args.reduction}"
              f"{'; pipeline' if args.pipeline else ''}"
              f"; commit_every {args.commit_every}")
        if "overhead_ratio" in figures:
            o = figures["overhead"]
            print(f"per-step overhead of jaxft over a plain JAX loop: {o['ratio']:.3f} "
                  f"({o['elastic_ms']:.2f} vs {o['plain_ms']:.2f} ms)")
    elif args.bench == "kill":
        from jaxft.bench.kill import bench_kill

        figures = bench_kill(args.n, args.phase, args.kills, args.every, args.step_sleep, args.heartbeat,
                             args.admission, args.run_dir)
        print(f"kill ({figures['phase']}) -> survivors' next commit: median "
              f"{figures['median_kill_to_next_commit_s']} s, each {figures['kill_to_next_commit_s']} "
              f"({figures['processes']} processes, heartbeat {figures['heartbeat_s']} s, "
              f"admission {figures['admission']})")
        print(f"rejoin: initialize() -> first commit median {figures['median_init_to_first_commit_s']} s; "
              f"survivors' largest gap between commits meanwhile median {figures['median_survivors_max_gap_s']} s")
    elif args.bench == "checkpoint":
        from jaxft.bench.checkpoint import bench_async_vs_sync, format_figures

        figures = bench_async_vs_sync(args.mb * 1e6, args.repeats, args.dir)
        print(format_figures(figures))
    else:
        from jaxft.bench.rehydrate import bench_rehydrate

        figures = bench_rehydrate(args.n, args.mb)
        print(f"rehydrate {figures['bytes'] / 1e6:.1f} MB: {figures['seconds']:.3f} s "
              f"({figures['mb_per_s']} MB/s); TCP loopback {figures['socket_seconds']:.3f} s "
              f"({figures['socket_mb_per_s']} MB/s); ratio {figures['ratio']} (time; rate ratio "
              f"{figures['rate_ratio']}) (correct: {figures['correct']})")
        print("peak extra host memory (RSS high-water over a transfer less the result's own leaves), "
              "first transfer / later ones: " + ", ".join(f"{role} {m['first']} / {m['warm']} MB"
                                                          for role, m in figures["peak_extra_mb"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


def _batching(every: int | str, deferred: int) -> str:
    """The overhead line's words for ``commit_every``."""
    if every == "auto":
        return f", commit_every auto ({deferred} steps deferred)"
    return f", a commit every {every} steps" if int(every) > 1 else ", a commit every step"

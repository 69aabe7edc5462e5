"""A small MLP on a deterministic synthetic regression set, trained elastically.

The workload of ``jaxft bench chaos`` (shipped in the package so the benchmark runs from
an installed jaxft) and the program behind ``examples/mlp.py``:

Plain single process:   python -m jaxft.bench.mlp --steps 30      (or python examples/mlp.py)
Three processes:        jaxft launch -n 3 --run-dir runs/mlp -- python -m jaxft.bench.mlp --steps 30
With checkpoints:       jaxft launch -n 3 --restart on-failure --run-dir runs/mlp -- \
                            python -m jaxft.bench.mlp --steps 30 --checkpoint_every 5
"""

from absl import app, flags, logging

import jaxft

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 30, "steps to train")
flags.DEFINE_integer("global_batch", 96, "examples per step, whatever the number of processes")
flags.DEFINE_integer("seed", 0, "seed of the parameter init and the data order")
flags.DEFINE_integer("micro_batch", 0, "examples per device per micro-batch (0: no accumulation)")
flags.DEFINE_enum("reduction", "allreduce", ["allreduce", "allreduce64", "exact"],
                  "allreduce: the gradient sum's rounding depends on the number of processes; allreduce64: "
                  "fixed chunks summed in float64, in practice independent of it; exact: bitwise independent "
                  "of it (see jaxft.ElasticTrainer)")
flags.DEFINE_integer("exact_chunks", 8, "with --reduction allreduce64 or exact: chunks per global batch "
                     "(must divide it)")
flags.DEFINE_integer("check_every", 10, "verify bitwise-identical params every N steps (0: never)")
flags.DEFINE_integer("hidden", 64, "hidden width")
flags.DEFINE_float("learning_rate", 1e-2, "Adam learning rate")
flags.DEFINE_integer("num_examples", 4096, "dataset size")
flags.DEFINE_float("step_sleep", 0.0, "seconds to sleep per committed step, in on_commit (to stretch demos; "
                   "with commit_every, once per commit for all its steps)")
flags.DEFINE_integer("checkpoint_every", 0, "async Orbax checkpoint every K committed steps (0: off); "
                     "on start, restore the latest complete checkpoint if there is one")
flags.DEFINE_string("checkpoint_dir", None, "checkpoint directory (default: $JAXFT_RUN_DIR/checkpoints)")
flags.DEFINE_enum("admission", "ready", ["ready", "connect"],
                  "ready: the others train on while a restarted process sets up, and admit it once it is "
                  "ready (jaxft.worker.admission); connect: it is a member from its first step (the others wait)")
flags.DEFINE_integer("keep", 3, "complete checkpoints to keep (max_to_keep; 0: keep all)")
flags.DEFINE_integer("precompile", 0, "compile the step for each member set one failure away in the "
                     "background while there are at most this many members (0: off; see jaxft.worker.warmup)")
flags.DEFINE_string("commit_every", "auto", "one commit query per this many steps, or auto (jaxft.ElasticLoop's "
                    "commit_every: a failure undoes the steps since the last commit)")
flags.register_validator("commit_every", jaxft.valid_commit_every, "--commit_every: auto or an int >= 1")
flags.DEFINE_bool("pipeline", False, "start each step's program before the previous step's commit query "
                  "(jaxft.ElasticLoop's pipeline: the query's round trip hidden behind the program)")
flags.DEFINE_bool("hold_jax_params", False, "keep the initial params as jax arrays for the whole run, as a "
                  "program that passes them unconverted does (it keeps the first CPU backend alive after a "
                  "rebuild: the backend_leaked event)")
flags.DEFINE_string("final_params", None, "write each process's final params to DIR/final-p<P>.npz "
                    "(for leaf-by-leaf comparisons)")


def make_dataset(num_examples: int, features: int = 16):
    """y = a fixed random teacher of x plus noise; the same for every process and run."""
    import numpy as np

    rng = np.random.default_rng(1234)
    x = rng.normal(size=(num_examples, features)).astype(np.float32)
    w1 = rng.normal(size=(features, 32)) / np.sqrt(features)
    w2 = rng.normal(size=(32, 1)) / np.sqrt(32)
    y = (np.tanh(x @ w1) @ w2 + 0.05 * rng.normal(size=(num_examples, 1))).astype(np.float32)
    return {"x": x, "y": y}


def init_params(seed: int, features: int, hidden: int) -> dict:
    """The MLP's initial params: float32 numpy arrays, the same in every process for ``seed``.

    Drawn with numpy rather than ``jax.random``: jax's threefry program took longer to compile,
    in every process of every run with a fresh persistent cache (every test), than importing
    jax; op by op it was slower still (measured: docs/benchmarks.md, 'Figures behind the
    code')."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def normal(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)

    w1, w2, w3 = normal(features, hidden), normal(hidden, hidden), normal(hidden, 1)
    return {"w1": w1, "b1": np.zeros((hidden,), np.float32), "w2": w2, "b2": np.zeros((hidden,), np.float32),
            "w3": w3, "b3": np.zeros((1,), np.float32)}


def loss_fn(params, batch):
    """Per-example squared error, shape [B]."""
    import jax.numpy as jnp

    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    h = jnp.tanh(h @ params["w2"] + params["b2"])
    pred = h @ params["w3"] + params["b3"]
    return jnp.sum((pred - batch["y"]) ** 2, axis=-1)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # keep jax's INFO lines out of the workers' output
    if FLAGS.checkpoint_every:
        from jaxft.worker import checkpoint  # noqa: F401 - Orbax imports slowly: do it before joining the job
    # before any other JAX use
    rt = jaxft.initialize(options=jaxft.InitOptions(wait_until_forgotten=FLAGS.admission == "ready"))
    import time

    import jax
    import numpy as np
    import optax

    dataset = make_dataset(FLAGS.num_examples)
    # host arrays: no array of the first CPU backend outlives its rebuild, unless asked for
    params = init_params(FLAGS.seed, dataset["x"].shape[1], FLAGS.hidden)
    if FLAGS.hold_jax_params:
        params = jax.tree_util.tree_map(jax.numpy.asarray, params)
    data = jaxft.GlobalBatches(dataset, FLAGS.global_batch, seed=FLAGS.seed)

    ckpt = None
    if FLAGS.checkpoint_every:
        from jaxft.worker.checkpoint import resolve_directory

        options = jaxft.CheckpointOptions(every=FLAGS.checkpoint_every, keep=FLAGS.keep or None,
                                          metadata={"model": "mlp", "hidden": FLAGS.hidden, "init_seed": FLAGS.seed})
        ckpt = jaxft.ElasticCheckpointer(resolve_directory(FLAGS.checkpoint_dir), runtime=rt, data=data,
                                         options=options)

    printed = [-1, None]  # (the step of the last line printed, of the last commit)

    def on_commit(trainer, record):  # (once per commit: with commit_every, for its last step)
        if ckpt is not None:
            ckpt.on_commit(trainer, record)
        if record.step // 10 > printed[0] // 10 or record.step == FLAGS.steps - 1:  # a line per 10 steps
            printed[0] = record.step
            print(f"step {record.step:4d} loss {record.loss:.5f} members {list(record.members)}", flush=True)
        if FLAGS.step_sleep:  # (the steps this commit made: one each, or those since the last commit)
            steps = record.step - printed[1] if printed[1] is not None else 1
            time.sleep(FLAGS.step_sleep * max(steps, 1))
        printed[1] = record.step

    chunked = FLAGS.reduction != "allreduce"
    reduction = jaxft.Reduction(FLAGS.reduction, chunks=FLAGS.exact_chunks if chunked else None,
                                micro_batch=FLAGS.micro_batch or None)
    options = jaxft.LoopOptions(check_every=FLAGS.check_every, precompile=FLAGS.precompile, pipeline=FLAGS.pipeline,
                                commit_every=jaxft.parse_commit_every(FLAGS.commit_every), admission=FLAGS.admission)
    trainer = jaxft.ElasticTrainer(loss_fn, optax.adam(FLAGS.learning_rate), params, data, runtime=rt,
                                   on_commit=on_commit, options=options, reduction=reduction)
    if ckpt is not None:
        restored = ckpt.restore(trainer)  # cold restore (put off by a restart whose peers train on)
        if restored is not None:
            print(f"restored step {restored.step} from {restored.path}", flush=True)
    state = trainer.run(FLAGS.steps)
    if ckpt is not None:
        ckpt.close()
    if FLAGS.final_params:
        import os

        os.makedirs(FLAGS.final_params, exist_ok=True)
        np.savez(os.path.join(FLAGS.final_params, f"final-p{rt.process_id}.npz"),
                 **{k: np.asarray(v) for k, v in state.params.items()})
    loss = "n/a (no step trained in this life)" if trainer.last_loss is None else f"{trainer.last_loss:.6f}"
    print(f"done: step {state.step} loss {loss}", flush=True)


if __name__ == "__main__":
    app.run(main)

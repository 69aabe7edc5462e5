"""A flax CNN + optax on scikit-learn's handwritten digits (shipped with the package).

    python examples/flax_digits.py --steps 50                      # one process
    jaxft launch -n 4 --restart on-failure --run-dir runs/digits --fault kill-all:step=40 \
        --fault kill:process=0:step=15 -- python examples/flax_digits.py --steps 60 --checkpoint_every 10

Nothing is downloaded: ``sklearn.datasets.load_digits`` reads 1797 8x8 images from the
installed package. The model's params are an ordinary flax pytree, so ElasticTrainer
treats them like any other.
"""

from absl import app, flags, logging

import jaxft

flags.DEFINE_integer("steps", 60, "steps to train")
flags.DEFINE_integer("global_batch", 256, "examples per step, whatever the number of processes")
flags.DEFINE_integer("seed", 0, "seed of the init and the data order")
flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate")
flags.DEFINE_integer("micro_batch", 0, "examples per device per micro-batch (0: no accumulation)")
flags.DEFINE_integer("check_every", 20, "verify bitwise-identical params every N steps")
flags.DEFINE_float("step_sleep", 0.0, "seconds to sleep per committed step, in on_commit (to stretch demos; "
                   "with commit_every, once per commit for all its steps)")
flags.DEFINE_integer("checkpoint_every", 0, "async Orbax checkpoint every K steps (0: off); restores on start")
flags.DEFINE_string("checkpoint_dir", None, "checkpoint directory (default: $JAXFT_RUN_DIR/checkpoints)")
flags.DEFINE_integer("precompile", 0, "compile the step for the member sets one failure away in the "
                     "background while there are at most this many members (0: off; jaxft.worker.warmup)")
flags.DEFINE_enum("admission", "ready", ["ready", "connect"],
                  "connect: a restarted process is a member from its first step (the others wait for its "
                  "set-up); ready: the others train on and admit it once it is ready (jaxft.worker.admission)")
flags.DEFINE_bool("pipeline", False, "start each step's program before the previous step's commit query "
                  "(jaxft.ElasticLoop's pipeline)")
flags.DEFINE_string("commit_every", "auto", "one commit query per this many steps, or auto (jaxft.ElasticLoop's "
                    "commit_every: a failure undoes the steps since the last commit)")
flags.register_validator("commit_every", jaxft.valid_commit_every, "--commit_every: auto or an int >= 1")
FLAGS = flags.FLAGS


def load():
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]  # [N, 8, 8, 1]
    y = digits.target.astype(np.int32)
    n_test = 297
    return {"x": x[n_test:], "y": y[n_test:]}, {"x": x[:n_test], "y": y[:n_test]}


def make_model():
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(32, (3, 3))(x))
            x = nn.relu(nn.Conv(64, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            x = x.reshape((x.shape[0], -1))
            x = nn.relu(nn.Dense(128)(x))
            return nn.Dense(10)(x)

    return CNN()


def main(_):
    logging.set_verbosity(logging.WARNING)  # keep jax's INFO lines out of the workers' output
    # Slow set-up that needs no JAX backend comes first: a restarted process joins the
    # live set when it connects, and the others wait for it at their next step.
    import time

    import numpy as np
    import optax

    if FLAGS.checkpoint_every:
        from jaxft.worker import checkpoint  # noqa: F401 - Orbax imports slowly
    train, test = load()
    model = make_model()
    # before any JAX computation
    rt = jaxft.initialize(options=jaxft.InitOptions(wait_until_forgotten=FLAGS.admission == "ready"))
    import jax

    # host copies: a jax array kept alive across a rejoin's CPU backend rebuild keeps the old one's memory
    params = jax.tree_util.tree_map(np.array, model.init(jax.random.key(FLAGS.seed), train["x"][:1])["params"])

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    data = jaxft.GlobalBatches(train, FLAGS.global_batch, seed=FLAGS.seed)
    ckpt = None
    if FLAGS.checkpoint_every:
        from jaxft.worker.checkpoint import resolve_directory

        ckpt = jaxft.ElasticCheckpointer(resolve_directory(FLAGS.checkpoint_dir), runtime=rt, data=data,
                                         options=jaxft.CheckpointOptions(every=FLAGS.checkpoint_every,
                                                                         metadata={"model": "flax_digits_cnn"}))

    printed = [-1, None]  # (the step of the last line printed, of the last commit)

    def on_commit(trainer, record):  # (once per commit: with commit_every, for its last step)
        if ckpt is not None:
            ckpt.on_commit(trainer, record)
        if record.step // 10 > printed[0] // 10:  # a line per 10 steps
            printed[0] = record.step
            print(f"step {record.step:4d} loss {record.loss:.4f} members {list(record.members)}", flush=True)
        if FLAGS.step_sleep:  # (the steps this commit made: one each, or those since the last commit)
            steps = record.step - printed[1] if printed[1] is not None else 1
            time.sleep(FLAGS.step_sleep * max(steps, 1))
        printed[1] = record.step

    options = jaxft.LoopOptions(check_every=FLAGS.check_every, precompile=FLAGS.precompile, pipeline=FLAGS.pipeline,
                                commit_every=jaxft.parse_commit_every(FLAGS.commit_every), admission=FLAGS.admission)
    trainer = jaxft.ElasticTrainer(loss_fn, optax.adam(FLAGS.learning_rate), params, data, runtime=rt,
                                   on_commit=on_commit, options=options,
                                   reduction=jaxft.Reduction(micro_batch=FLAGS.micro_batch or None))
    if ckpt is not None and (restored := ckpt.restore(trainer)) is not None:
        print(f"restored step {restored.step} from {restored.path}", flush=True)
    state = trainer.run(FLAGS.steps)
    if ckpt is not None:
        ckpt.close()
    logits = model.apply({"params": jax.tree_util.tree_map(np.asarray, state.params)}, test["x"])
    accuracy = float((np.asarray(logits).argmax(-1) == test["y"]).mean())
    rt.events.log("eval", step=state.step, test_accuracy=accuracy)
    print(f"done: step {state.step} loss {trainer.last_loss:.4f} test accuracy {accuracy:.3f}", flush=True)


if __name__ == "__main__":
    app.run(main)

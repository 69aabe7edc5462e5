"""A small MLP on a deterministic synthetic regression set, trained elastically.

The program itself is :mod:`jaxft.bench.mlp` (it is also the workload of ``jaxft bench
chaos``, so it ships inside the package); read it there. This file runs it from a checkout:

Plain single process:   python examples/mlp.py --steps 30
Three processes:        jaxft launch -n 3 --run-dir runs/mlp -- python examples/mlp.py --steps 30
With checkpoints:       jaxft launch -n 3 --restart on-failure --run-dir runs/mlp -- \
                            python examples/mlp.py --steps 30 --checkpoint_every 5
"""

from absl import app

from jaxft.bench.mlp import main

if __name__ == "__main__":
    app.run(main)

#!/bin/bash
# One node's agent, started by srun once per node: COORDINATOR_HOST:PORT RUN_DIR COMMAND...
# SLURM sets SLURM_NNODES and SLURM_NODEID; JAXFT_AGENT_ARGS adds launch options
# (e.g. "--gloo-interface ib0" for CPU collectives, "-n 2 --gpus none" on CPU nodes).
set -euo pipefail
COORDINATOR=$1
RUN_DIR=$2
shift 2
# shellcheck disable=SC2086  # JAXFT_AGENT_ARGS is a list of options
exec jaxft launch --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --coordinator "$COORDINATOR" \
    --restart on-failure --run-dir "$RUN_DIR" ${JAXFT_AGENT_ARGS:-} -- "$@"

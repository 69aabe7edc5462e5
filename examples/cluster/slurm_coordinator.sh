#!/bin/bash
# The coordination service step of slurm.sbatch: PORT NUM_PROCESSES.
set -euo pipefail
exec jaxft coordinator --bind "${JAXFT_BIND:-0.0.0.0}" --port "$1" --num-processes "$2" \
    --heartbeat-timeout "${JAXFT_HEARTBEAT_TIMEOUT:-10}"

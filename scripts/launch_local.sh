#!/usr/bin/env bash
# The main job: a multi-process elastic training run with failures injected, then a summary.
#
#   scripts/launch_local.sh            # 3 CPU processes (or one per local GPU)
#   N=4 STEPS=80 scripts/launch_local.sh
#
# Creates .venv on first use. Every process, process 0 included, is killed at least once
# and restarted; the survivors keep training, the restarted ones are rehydrated from a
# live peer, and all of them end with bitwise-identical parameters.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[launch_local] creating .venv and installing jaxft (first run only)"
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test]'
fi
.venv/bin/python -c "import jaxft" 2>/dev/null || .venv/bin/python -m pip install -q -e '.[test]'

GPUS=none
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPUS=auto
  N=${N:-$(nvidia-smi -L | grep -c '^GPU ')}
fi
N=${N:-3}
STEPS=${STEPS:-60}
RUN_DIR=${RUN_DIR:-runs/launch_local-$(date +%Y%m%d-%H%M%S)}
LAST=$((N - 1))

echo "[launch_local] $N processes, $STEPS steps, run dir $RUN_DIR"
set +e
.venv/bin/jaxft launch -n "$N" --gpus "$GPUS" --restart on-failure --run-dir "$RUN_DIR" \
  --fault "kill:process=0:step=$((STEPS / 6))" \
  --fault "kill:process=$LAST:step=$((STEPS / 3)):phase=before-step" \
  --fault "kill:process=0:step=$((STEPS / 2)):phase=after-commit" \
  --fault "kill:process=1:step=$((2 * STEPS / 3))" \
  -- .venv/bin/python examples/mlp.py --steps "$STEPS" --step_sleep 0.05
code=$?
set -e
echo
echo "================ run summary ($RUN_DIR) ================"
.venv/bin/jaxft report "$RUN_DIR"
echo "launcher exit code: $code"
exit $code

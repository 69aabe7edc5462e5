#!/usr/bin/env bash
# The main job: a flax CNN + optax on scikit-learn's digits, trained by 4 CPU processes
# (or one per local GPU) while processes die, then a summary and a report picture.
#
#   scripts/launch_local.sh
#   N=3 STEPS=200 scripts/launch_local.sh
#   ADMISSION=connect scripts/launch_local.sh   # restarted processes join at once (the others wait)
#   PRECOMPILE=8 scripts/launch_local.sh        # process 0 compiles the meshes one failure away ahead
#   PIPELINE=1 scripts/launch_local.sh          # each step's program starts during the last commit
#   COMMIT_EVERY=5 scripts/launch_local.sh      # one commit query per 5 steps (a divisor of the checkpoints' 10;
#                                               # default auto: jaxft decides, see docs/design.md)
#
# Creates .venv on first use. Faults: process 0 is killed mid-step at STEPS/10 (the others
# retry the step without it), the last process dies before step STEPS/6 while process 0 is
# still setting up; both are rehydrated from a live peer and rejoin; then, right after the
# first step committed at full width from 7*STEPS/10 on (width=N: whatever this machine's
# speed), every process dies at once (a cold restart from the latest complete Orbax
# checkpoint). All processes end with bitwise-identical parameters. Too few STEPS for the
# rejoins (100-200 steps each on two cores): the kill-all never fires.
# Ready admission (the default here): the others train on while a restarted process sets up.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
# quiet_pip ARGS...: pip -q with its warnings kept out of sight unless it fails.
quiet_pip() {
  local log
  log=$(mktemp)
  if ! .venv/bin/python -m pip install -q "$@" >"$log" 2>&1; then
    cat "$log"; rm -f "$log"; return 1
  fi
  rm -f "$log"
}
if [ ! -x .venv/bin/python ]; then
  echo "[launch_local] creating .venv and installing jaxft (first run only)"
  "$PY" -m venv .venv
  quiet_pip --upgrade pip
  quiet_pip -e '.[test]'
fi
.venv/bin/python -c "import jaxft, rich, grain" 2>/dev/null || quiet_pip -e '.[test]'

GPUS=none
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPUS=auto
  N=${N:-$(nvidia-smi -L | grep -c '^GPU ')}
fi
N=${N:-4}
STEPS=${STEPS:-400}
ADMISSION=${ADMISSION:-ready}
PRECOMPILE=${PRECOMPILE:-0}  # N: process 0 compiles the one-failure meshes ahead (see docs/design.md)
PIPELINE=${PIPELINE:-0}  # 1: jaxft.LoopOptions(pipeline=True) (see docs/design.md)
COMMIT_EVERY=${COMMIT_EVERY:-auto}  # N or auto: jaxft.LoopOptions(commit_every=...) (see docs/design.md)
RUN_DIR=${RUN_DIR:-runs/launch_local-$(date +%Y%m%d-%H%M%S)}
LAST=$((N - 1))

echo "[launch_local] $N processes, $STEPS steps, run dir $RUN_DIR"
set +e
.venv/bin/jaxft launch -n "$N" --gpus "$GPUS" --restart on-failure --run-dir "$RUN_DIR" \
  --fault "kill:process=0:step=$((STEPS / 10))" \
  --fault "kill:process=$LAST:step=$((STEPS / 6)):phase=before-step" \
  --fault "kill-all:step=$((7 * STEPS / 10)):phase=after-commit:width=$N" \
  -- .venv/bin/python examples/flax_digits.py --steps "$STEPS" --checkpoint_every 10 --admission "$ADMISSION" \
     --precompile "$PRECOMPILE" "$([ "$PIPELINE" = 1 ] && echo --pipeline || echo --nopipeline)" \
     --commit_every "$COMMIT_EVERY"
code=$?
set -e
echo
echo "================ run summary ($RUN_DIR) ================"
.venv/bin/jaxft report "$RUN_DIR"
echo "launcher exit code: $code"
exit $code

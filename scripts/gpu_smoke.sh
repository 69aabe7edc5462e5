#!/usr/bin/env bash
# GPU smoke check, for a machine with at least one NVIDIA GPU (not part of CI).
#
#   scripts/gpu_smoke.sh            # installs jaxft (+ its cuda12 extra unless jax already sees a GPU)
#
# 1. jaxft.initialize() in one process: the recoverability config, the NCCL-abort XLA flags
#    and env vars it sets, the devices jax sees;
# 2. a jitted step on the GPU;
# 3. a single-process ElasticTrainer run (the mlp workload, 20 steps);
# 4. `jaxft launch` with the default GPU assignment (one worker per local GPU), the same run.
# Each part prints PASS/FAIL; the script exits non-zero if any failed. Output also goes to
# $OUT/gpu_smoke.log when OUT is set. One GPU cannot exercise multi-process NCCL.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log=${OUT:+$OUT/gpu_smoke.log}
exec > >(tee ${log:+"$log"}) 2>&1

python=${PYTHON:-python3}
status=0
part() { echo; echo "== $1"; }
result() { if [ "$1" -eq 0 ]; then echo "PASS: $2"; else echo "FAIL: $2 (exit $1)"; status=1; fi; }

part "machine"
nvidia-smi -L || echo "nvidia-smi not found"
"$python" --version

part "install"
if ! "$python" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
    "$python" -m pip install -q -e '.[cuda12]' || status=1
else
    "$python" -m pip install -q --no-deps -e . || status=1
fi
"$python" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__)'

part "initialize + a jitted step"
timeout 300 "$python" - <<'EOF'
import os
import jaxft

rt = jaxft.initialize()
import jax
import jax.numpy as jnp

print("source", rt.source, "process", rt.process_id, "of", rt.num_processes)
print("devices", jax.devices())
print("XLA_FLAGS", os.environ.get("XLA_FLAGS"))
for k in sorted(os.environ):
    if k.startswith(("XLA_PYTHON_CLIENT", "NCCL", "JAXFT_")):
        print(k, "=", os.environ[k])
print("jax_enable_recoverability", getattr(jax.config, "jax_enable_recoverability", "?"))
assert jax.default_backend() == "gpu", f"backend is {jax.default_backend()}, not gpu"
x = jnp.ones((4096, 4096), jnp.float32)
y = jax.jit(lambda a: (a @ a).sum())(x)
print("jit result", float(y))
assert float(y) == 4096.0 ** 3
EOF
result $? "initialize + jitted step on the GPU"

part "single-process ElasticTrainer (mlp, 20 steps)"
timeout 300 "$python" -m jaxft.bench.mlp --steps 20 --check_every 5
result $? "single-process ElasticTrainer"

part "jaxft launch, default GPU assignment (one worker per GPU)"
run_dir=$(mktemp -d /tmp/jaxft-gpu-smoke-XXXX)
timeout 600 "$python" -m jaxft.cli launch --run-dir "$run_dir" -- "$python" -m jaxft.bench.mlp --steps 20
result $? "jaxft launch with --gpus auto"
grep -h '"final"' "$run_dir/events.jsonl" || true

echo
if [ $status -eq 0 ]; then echo "gpu_smoke: all parts passed"; else echo "gpu_smoke: some parts FAILED"; fi
exit $status

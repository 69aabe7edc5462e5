#!/usr/bin/env bash
# GPU smoke check, for a machine with at least one NVIDIA GPU (not part of CI).
#
#   scripts/gpu_smoke.sh
#
# Where jax already sees a GPU nothing is installed (such a machine may have no registry):
# jaxft runs from this checkout (PYTHONPATH) on the jax, optax, Orbax and flax found there,
# plus any wheels in .whl/ (installed with --no-index into a folder of their own, first on
# the path). jaxft refuses an orbax-checkpoint outside its bound: where the machine's is
# older (0.12.4 on the H200 image seen so far), bring one, e.g. on a machine with pip:
#   pip download --no-deps --only-binary=:all: -d .whl 'orbax-checkpoint>=0.12.8,<0.13'
# Else it installs jaxft with its cuda12 extra first.
#
# 1. jaxft.initialize() in one process: the recoverability config, the NCCL-abort XLA flags
#    and env vars it sets, the devices jax sees;
# 2. a jitted step on the GPU;
# 3. a single-process ElasticTrainer run (the mlp workload, 20 steps);
# 4. `jaxft launch` with the default GPU assignment (one worker per local GPU), the same run;
# 5. the same under `jaxft launch --restart on-failure` with Orbax checkpoints every 5 steps,
#    the worker SIGKILLed at step 12: restarted, restored, finished (params compared with 4's);
# 6. tests/test_private_api.py on this jax (the borrowed jaxlib internals; CPU, as in CI);
# 7. `jaxft launch -n 2 --gpus none` on this GPU node: CPU workers, the same run;
# 8. figures: the elastic step's per-step overhead over a plain loop, one GPU process
#    (a ~20 ms step and a small one; each also with `pipeline`, the commit query run while
#    the next step's program computes), and two CPU processes as `jaxft bench overhead -n 2`
#    runs in the issue tracker's figures (skipped with GPU_SMOKE_FIGURES=0).
# Each part prints PASS/FAIL; the script exits non-zero if any failed. Output also goes to
# $OUT/gpu_smoke.log and the run directories' events to $OUT/runs.tgz when OUT is set.
# One GPU cannot exercise multi-process NCCL.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
log=${OUT:+$OUT/gpu_smoke.log}
exec > >(tee ${log:+"$log"}) 2>&1

python=${PYTHON:-python3}
status=0
runs=$(mktemp -d /tmp/jaxft-gpu-smoke-XXXX)
part() { echo; echo "== $1 ($(date +%T))"; }
result() { if [ "$1" -eq 0 ]; then echo "PASS: $2"; else echo "FAIL: $2 (exit $1)"; status=1; fi; }
final() { grep -h '"final"' "$1/events.jsonl" | head -4 || true; }
overhead() {  # overhead NAME LAUNCH_ARGS... -- STEPS HIDDEN BATCH
    local name=$1; shift
    local args=(); while [ "$1" != "--" ]; do args+=("$1"); shift; done; shift
    timeout 240 "$python" -m jaxft.cli launch "${args[@]}" --console raw --run-dir "$runs/$name" -- \
        "$python" -m jaxft.bench.overhead "$@" >"$runs/$name.out" 2>&1
    local rc=$?
    grep -h '"bench_overhead"' "$runs/$name/events.jsonl" | head -1 || tail -20 "$runs/$name.out"
    result $rc "overhead: $name"
}

part "machine"
nvidia-smi -L || echo "nvidia-smi not found"
nproc
"$python" --version

part "install"
if "$python" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
    echo "jax sees a GPU: running jaxft from $repo without installing"
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
    if compgen -G ".whl/*.whl" >/dev/null; then
        site=$(mktemp -d /tmp/jaxft-gpu-site-XXXX)
        "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || status=1
        export PYTHONPATH="$repo:$site:$PYTHONPATH"
        echo "with the wheels of .whl/: $(cd .whl && ls *.whl | tr '\n' ' ')"
    fi
else
    "$python" -m pip install -q -e '.[cuda12]' || status=1
fi
"$python" - <<'EOF'
from importlib.metadata import PackageNotFoundError, version
for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "optax", "orbax-checkpoint", "flax",
             "numpy", "ml_dtypes", "absl-py", "rich", "scikit-learn", "pytest"):
    try:
        print(f"{name} {version(name)}")
    except PackageNotFoundError:
        pass
import jaxft
print("jaxft from", jaxft.__file__)
EOF

part "initialize + a jitted step"
timeout 180 "$python" - <<'EOF'
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
timeout 180 "$python" -m jaxft.bench.mlp --steps 20 --check_every 5
result $? "single-process ElasticTrainer"

part "jaxft launch, default GPU assignment (one worker per GPU)"
timeout 240 "$python" -m jaxft.cli launch --console raw --run-dir "$runs/gpu" -- "$python" -m jaxft.bench.mlp --steps 20
result $? "jaxft launch with --gpus auto"
final "$runs/gpu"

part "jaxft launch: the GPU worker killed at step 12, restarted, resumed from its Orbax checkpoint"
timeout 240 "$python" -m jaxft.cli launch --console raw --restart on-failure --run-dir "$runs/gpu-ckpt" \
    --fault kill:process=0:step=12 -- "$python" -m jaxft.bench.mlp --steps 20 --checkpoint_every 5
result $? "kill, restart and restore on the GPU"
grep -h '"restored"\|"checkpoint_restored"\|"restore' "$runs/gpu-ckpt/events.jsonl" | head -3 || true
final "$runs/gpu-ckpt"
a=$(grep -h '"final"' "$runs/gpu/events.jsonl" 2>/dev/null | grep -o '"params_sha256": "[0-9a-f]*"' | head -1)
b=$(grep -h '"final"' "$runs/gpu-ckpt/events.jsonl" 2>/dev/null | grep -o '"params_sha256": "[0-9a-f]*"' | head -1)
if [ -n "$a" ] && [ "$a" = "$b" ]; then echo "final params bitwise equal to the fault-free GPU run's"
else echo "final params differ from the fault-free GPU run's ($a vs $b)"; fi

part "private jaxlib API on this jax (tests/test_private_api.py, CPU)"
JAX_PLATFORMS=cpu timeout 240 "$python" -m pytest -q -p no:cacheprovider tests/test_private_api.py
result $? "tests/test_private_api.py"

part "jaxft launch -n 2 --gpus none on a GPU node (CPU workers)"
timeout 240 "$python" -m jaxft.cli launch -n 2 --gpus none --console raw --run-dir "$runs/cpu" -- \
    "$python" -m jaxft.bench.mlp --steps 20
result $? "jaxft launch --gpus none"
final "$runs/cpu"

if [ "${GPU_SMOKE_FIGURES:-1}" = 1 ]; then  # GPU_SMOKE_FIGURES=0: checks only (~40 s less)
    part "figures: per-step overhead of the elastic step over a plain loop"
    overhead gpu-1proc-h4096-b4096 -- 100 4096 4096
    overhead gpu-1proc-h512-b512 -- 100 512 512
    overhead gpu-1proc-h4096-b4096-pipeline -- 100 4096 4096 ready allreduce 1
    overhead gpu-1proc-h512-b512-pipeline -- 100 512 512 ready allreduce 1
    overhead cpu-2proc-h512-b1536 -n 2 --gpus none -- 100 512 1536
fi

if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/runs.tgz" -C "$runs" . 2>/dev/null || true
fi
echo
if [ $status -eq 0 ]; then echo "gpu_smoke: all parts passed"; else echo "gpu_smoke: some parts FAILED"; fi
exit $status

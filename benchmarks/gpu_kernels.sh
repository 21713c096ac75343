#!/usr/bin/env bash
# GPU check of the Pallas cache-attention kernels, one command from the repo root:
#
#   bash benchmarks/gpu_kernels.sh [extra args for python -m benchmarks.gpu_kernels]
#
# 1. finds a Python whose jax sees a CUDA GPU (the repo's .venv, else python3); if none does,
#    installs "jax[cuda13]" (+ the few packages the kernels and tests import) into python3;
# 2. runs tests/kernels/test_kernels_cache_attention.py natively on the GPU (not interpret mode):
#    every kernel against the XLA reference, dispatch, and CUDA lowering;
# 3. benchmarks xla / triton / mosaic on Llama-3-8B verify attention (H=32, KVH=8, D=128,
#    T=8; context 1k/8k/32k; batch 1/16/64; bf16 and fp8 KV).
# Writes results/gpu_kernels/{tests.log,bench.log,bench.json,bench.md}. Budget: < 8 minutes
# (tests <= 300 s, benchmark stops starting new combos after --budget-s, default 150 s).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR=${OUT_DIR:-results/gpu_kernels}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}

has_gpu_jax() {
  "$1" -c 'import jax, sys; sys.exit(0 if jax.default_backend() == "gpu" else 1)' >/dev/null 2>&1
}

PY=${GPU_KERNELS_PY:-}  # override (e.g. a CPU smoke run: GPU_KERNELS_PY=.venv/bin/python ... --smoke)
[ -n "$PY" ] || for cand in .venv/bin/python python3 python; do
  if command -v "$cand" >/dev/null 2>&1 && has_gpu_jax "$cand"; then PY=$cand; break; fi
done
if [ -z "$PY" ]; then
  PY=$(command -v python3 || command -v python)
  echo "== no jax with a CUDA GPU found; installing jax[cuda13] into $PY" >&2
  timeout 240 "$PY" -m pip install -q "jax[cuda13]>=0.10.2" \
    || { echo "pip install jax[cuda13] failed (no network?)" >&2; exit 2; }
  has_gpu_jax "$PY" || { echo "jax still sees no GPU; nvidia-smi:" >&2; nvidia-smi >&2; exit 2; }
fi
# The kernels import jaxtyping; the tests need pytest. Install only what is missing.
"$PY" -c 'import jaxtyping, numpy, pytest' >/dev/null 2>&1 \
  || timeout 120 "$PY" -m pip install -q jaxtyping numpy pytest \
  || { echo "could not install jaxtyping/numpy/pytest" >&2; exit 2; }

"$PY" - <<'EOF'
import jax
d = jax.devices()[0]
print(f"== jax {jax.__version__} on {d.device_kind} (sm {getattr(d, 'compute_capability', '?')})")
EOF

echo "== kernel tests on the GPU"
timeout "${TESTS_TIMEOUT_S:-300}" "$PY" -m pytest -q -p no:cacheprovider --timeout=120 -m "slow or not slow" tests/kernels/test_kernels_cache_attention.py 2>&1 \
  | tee "$OUT_DIR/tests.log"
test_rc=${PIPESTATUS[0]}

echo "== benchmark"
timeout 200 "$PY" -m benchmarks.gpu_kernels --out "$OUT_DIR" --budget-s 150 "$@" 2>&1 \
  | tee "$OUT_DIR/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "== tests rc=$test_rc, benchmark rc=$bench_rc; results in $OUT_DIR"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]

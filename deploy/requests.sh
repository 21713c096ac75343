#!/usr/bin/env bash
# Example requests against `python -m peagle_jax.serve` (default 127.0.0.1:8000).
# Usage: deploy/requests.sh [BASE_URL]   (set PEAGLE_API_KEY if the server was started with --api-key)
set -euo pipefail
BASE=${1:-http://127.0.0.1:8000}
DIR=$(cd "$(dirname "$0")" && pwd)
AUTH=()
if [[ -n "${PEAGLE_API_KEY:-}" ]]; then AUTH=(-H "Authorization: Bearer ${PEAGLE_API_KEY}"); fi

curl -s "$BASE/health"; echo
curl -s "${AUTH[@]}" "$BASE/v1/models"; echo
curl -s "${AUTH[@]}" "$BASE/v1/chat/completions" -H "Content-Type: application/json" -d @"$DIR/requests/chat.json"; echo
curl -sN "${AUTH[@]}" "$BASE/v1/completions" -H "Content-Type: application/json" -d @"$DIR/requests/completion_stream.json"
curl -s "$BASE/metrics" | grep -E '^peagle_(requests_total|generation_tokens_total|acceptance_length_(sum|count))'

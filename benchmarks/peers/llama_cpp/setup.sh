#!/usr/bin/env bash
# llama.cpp (llama-cpp-python, built from PyPI's source) as a benchmark peer (issue #51): its own
# venv, outside the repo, in which benchmarks/peers/llama_cpp/runner.py decodes the same GGUF
# file as ours, plainly and with llama.cpp's prompt lookup (LlamaPromptLookupDecoding).
#
#   bash benchmarks/peers/llama_cpp/setup.sh        (idempotent; about 10 minutes on 2 cores)
#
# Where: $LLAMA_CPP_PEER_DIR, default <repo>/../runs/peers/llama_cpp, holds venv/.
# How it is built: GGML_NATIVE=OFF with the vector sets this CPU has (AVX2/FMA/F16C, and
# AVX-512 with its VBMI / VNNI / BF16 extensions and AVX-VNNI where present) and AMX off: the
# native build's AMX path segfaulted on these machines.
set -euo pipefail
T0=$(date +%s)
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
DIR=${LLAMA_CPP_PEER_DIR:-$REPO/../runs/peers/llama_cpp}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
VENV=$DIR/venv
PY=$VENV/bin/python
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
say() { printf '[llama-cpp-peer %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
# shellcheck source=../lib.sh
source "$REPO/benchmarks/peers/lib.sh"

if [ ! -x "$PY" ]; then
  BASE=$(find_python 9) || { echo "llama.cpp peer: needs Python >= 3.9 (set PYTHON=...)" >&2; exit 1; }
  say "creating $VENV with $BASE"
  "$BASE" -m venv "$VENV"
  pip_q install -q --upgrade pip
fi
if ! "$PY" -c 'import llama_cpp' 2>/dev/null; then
  flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
  has() { case " $flags " in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c)"
  CMAKE_ARGS+=" -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)"
  CMAKE_ARGS+=" -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AVX_VNNI=$(has avx_vnni)"
  CMAKE_ARGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  say "building llama-cpp-python==$VERSION from source: CMAKE_ARGS=$CMAKE_ARGS"
  CMAKE_ARGS="$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) pip_q install -q --no-cache-dir \
    --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
fi
"$PY" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'
say "ready: $PY"

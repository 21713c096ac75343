"""Greedy exactness of speculative decoding on the real SmolLM2-135M-Instruct target."""

from __future__ import annotations

import numpy as np
import pytest

from peagle_jax.api import chat_ids
from peagle_jax.drafters import DrafterConfig, create_drafter
from peagle_jax.drafters.reference import ReferenceDrafter
from peagle_jax.generate import speculative_generate

pytestmark = pytest.mark.slow

MESSAGES = [
    "Write a Python function that reverses a string.",
    "What is 2+2?",
    "Name three colors.",
    "Explain in detail how a hash table handles collisions, with an example in Python code.",
]
BUDGET = 40


@pytest.fixture(scope="module")
def smollm2():
    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.default_model import default_model_path
    from peagle_jax.checkpoints.tokenizer import eos_token_ids, load_tokenizer

    path = default_model_path()
    target = load_target(path)
    tok = load_tokenizer(path)
    prompts = []
    for i, m in enumerate(MESSAGES):
        ids = chat_ids(tok, m)
        prompts.append(ids[: len(ids) - i])  # distinct lengths (trimmed prompts still end sensibly)
    prompts[1] = chat_ids(tok, MESSAGES[1])
    return target, prompts, eos_token_ids(tok, path)


@pytest.fixture(scope="module")
def reference(smollm2):
    target, prompts, eos = smollm2
    out = speculative_generate(target, None, prompts, method="none", max_new_tokens=BUDGET + 8, eos_token_ids=eos)
    # The batch must exercise both ways of finishing.
    short = [r for r, t in zip(out.finish_reasons, out.tokens, strict=True) if r == "stop" and len(t) < BUDGET]
    assert short and any(len(t) >= BUDGET for t in out.tokens)
    # The oracle's table continues past EOS (greedy without stopping), so even a round that
    # drafts across an EOS is fully accepted.
    full = speculative_generate(target, None, prompts, method="none", max_new_tokens=BUDGET + 8, eos_token_ids=[])
    out.table = _table(full.tokens)
    return out


def _table(tokens):
    n = max(len(t) for t in tokens)
    return np.array([t + [0] * (n - len(t)) for t in tokens])


# Both methods at two K (the bf16 suite, tests/generate/test_row_invariance.py, covers every K with the shipped heads).
@pytest.mark.parametrize("method,k", [("peagle", 1), ("peagle", 7), ("eagle3", 3), ("eagle3", 7)])
def test_random_drafter_exact(smollm2, reference, method, k):
    target, prompts, eos = smollm2
    cfg = DrafterConfig.for_target(target.config, num_layers=2, parallel_drafting=True, mask_token_id=0)
    drafter = create_drafter(cfg, seed=k)
    out = speculative_generate(target, drafter, prompts, method=method, num_draft_tokens=k,
                               max_new_tokens=BUDGET, eos_token_ids=eos)
    assert out.tokens == [t[:BUDGET] for t in reference.tokens]


@pytest.mark.parametrize("method,k", [("peagle", 1), ("peagle", 3), ("peagle", 7), ("eagle3", 3)])
def test_oracle_and_partial_drafter_exact(smollm2, reference, method, k):
    target, prompts, eos = smollm2
    vocab = target.config.vocab_size
    table = reference.table
    oracle = speculative_generate(target, ReferenceDrafter(table, vocab), prompts, method=method,
                                  num_draft_tokens=k, max_new_tokens=BUDGET, eos_token_ids=eos)
    assert oracle.tokens == [t[:BUDGET] for t in reference.tokens]
    assert oracle.mean_acceptance_length == pytest.approx(k + 1)
    partial = speculative_generate(target, ReferenceDrafter(table, vocab, wrong_every=3), prompts,
                                   method=method, num_draft_tokens=k, max_new_tokens=BUDGET, eos_token_ids=eos)
    assert partial.tokens == [t[:BUDGET] for t in reference.tokens]
    if k > 1:
        assert 1.0 < partial.mean_acceptance_length < k + 1

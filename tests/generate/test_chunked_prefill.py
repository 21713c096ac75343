"""Chunked prefill (`prefill_chunk` then `prefill` from an offset) against one-shot prefill."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import slow_except
from flax import nnx

from peagle_jax.drafters.hybrid import HybridProposer
from peagle_jax.drafters.ngram import NgramProposer
from peagle_jax.generate import steps
from peagle_jax.generate.steps import SpecConfig, empty_context
from peagle_jax.sampling import SamplingParams

# jitted (one compile each per config instead of op-by-op dispatch); config is static
prefill = nnx.jit(steps.prefill, static_argnums=4)
prefill_chunk = nnx.jit(steps.prefill_chunk, static_argnums=6)
spec_round = nnx.jit(steps.spec_round, static_argnums=3)

LENGTH = 37  # two full chunks of 16, then 5 tokens padded to 16
CHUNK = 16


def _drafter(method, head):
    return {"none": None, "peagle": head, "eagle3": head, "ngram": NgramProposer(2, 3),
            "peagle+ngram": HybridProposer(head, NgramProposer(2, 3), defer_rows=8)}[method]


def _rows(tree_a, tree_b, upto):
    """Assert two caches hold the same rows below position `upto` (KV: [B, KVH, S, D]; history: [B, S])."""
    for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.ndim == 4:
            np.testing.assert_allclose(a[:, :, :upto], b[:, :, :upto], rtol=1e-5, atol=1e-5)
        elif a.ndim == 2 and a.shape[1] > upto:
            np.testing.assert_array_equal(a[:, :upto], b[:, :upto])


@pytest.mark.parametrize("method", slow_except(["none", "peagle", "eagle3", "ngram", "peagle+ngram"],
                                                fast={"eagle3", "peagle+ngram"}))
def test_chunked_prefill_matches_one_shot(tiny_target, tiny_head, method):
    target, head = tiny_target, tiny_head
    drafter = _drafter(method, head)
    k = 0 if method == "none" else 3
    config = SpecConfig(method, k, True, 96, 32)
    prompt = np.asarray(jax.random.randint(jax.random.key(3), (LENGTH,), 1, target.config.vocab_size - 1), np.int32)
    common = dict(max_new=jnp.asarray([20]), sp=SamplingParams.full(1), eos_ids=jnp.asarray([-1]),
                  key=jax.random.split(jax.random.key(0), 1))
    lens = jnp.asarray([LENGTH], jnp.int32)

    padded = np.zeros((1, 48), np.int32)
    padded[0, :LENGTH] = prompt
    whole = prefill(target, drafter, jnp.asarray(padded), lens, config, **common)

    context = empty_context(target, drafter, 1, config)
    for start in range(0, LENGTH - CHUNK, CHUNK):  # the full chunks: 0..15, 16..31
        chunk = jnp.asarray(prompt[None, start:start + CHUNK])
        context = prefill_chunk(target, drafter, context, chunk, jnp.asarray(prompt[start + CHUNK : start + CHUNK + 1]),
                                jnp.asarray([start], jnp.int32), config)
    tail = np.zeros((1, CHUNK), np.int32)
    tail[0, : LENGTH - 32] = prompt[32:]
    chunked = prefill(target, drafter, jnp.asarray(tail), lens, config, context=context,
                      start=jnp.asarray([32], jnp.int32), **common)

    assert int(chunked.last_token[0]) == int(whole.last_token[0])
    assert chunked.target_cache.lengths.tolist() == [LENGTH]
    _rows(chunked.target_cache.layers, whole.target_cache.layers, LENGTH)
    if drafter is not None:  # drafter rows p < L-1 (row L-1 is the pending one)
        _rows(chunked.drafter_cache, whole.drafter_cache, LENGTH - 1)
    if whole.pending_feats is not None:
        np.testing.assert_allclose(chunked.pending_feats, whole.pending_feats, rtol=1e-5, atol=1e-5)

    # And the sequences decode the same tokens from there (greedy).
    for _ in range(6):
        whole, chunked = spec_round(target, drafter, whole, config), spec_round(target, drafter, chunked, config)
    assert chunked.output.tolist() == whole.output.tolist()
    assert int(whole.out_len[0]) > 6

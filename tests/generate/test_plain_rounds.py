"""Plain rounds of a head method (`SpecConfig.plain_rounds`): a 1-row step that leaves the
drafter for later, against rounds that run the drafter and accept nothing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import slow_except
from flax import nnx

from peagle_jax.generate import speculative_generate
from peagle_jax.generate.speculative import merge_models
from peagle_jax.generate.steps import SpecConfig, prefill, spec_round, step_jit
from peagle_jax.sampling import SamplingParams

K = 3
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13]]


@functools.partial(step_jit, static_argnames=("target_def", "head_def", "config"))
def _prefill(target_state, head_state, tokens, lens, *, target_def, head_def, config):
    target, head = merge_models(target_def, target_state, head_def, head_state)
    return prefill(target, head, tokens, lens, config, max_new=jnp.asarray([40, 40]), sp=SamplingParams.full(2),
                   eos_ids=jnp.asarray([-1]), key=jax.random.split(jax.random.key(0), 2))


@functools.partial(step_jit, static_argnames=("target_def", "head_def", "config"))
def _round(target_state, head_state, state, limit, *, target_def, head_def, config):
    target, head = merge_models(target_def, target_state, head_def, head_state)
    return spec_round(target, head, state._replace(draft_limit=limit), config)


def _run(target, head, config, schedule):
    """Rounds with draft limits 0 (plain) or K per the schedule's booleans, each round jitted
    (one compile per config instead of op-by-op dispatch)."""
    (target_def, target_state), (head_def, head_state) = nnx.split(target), nnx.split(head)
    models = dict(target_def=target_def, head_def=head_def, config=config)
    tokens = np.zeros((2, 16), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, : len(p)] = p
    lens = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    state = _prefill(target_state, head_state, jnp.asarray(tokens), lens, **models)
    for speculate in schedule:
        limit = jnp.full((2,), K if speculate else 0, jnp.int32)
        state = _round(target_state, head_state, state, limit, **models)
    return state


@pytest.mark.parametrize("method", slow_except(["peagle", "eagle3"], fast={"peagle"}))
def test_plain_rounds_defer_the_drafter_exactly(tiny_target, tiny_head, method):
    target, head = tiny_target, tiny_head
    # 7 plain rounds (the K+1-row pending buffer fills and is written to the drafter once),
    # then speculative ones: the same tokens as plain decoding, and the drafter's cache holds
    # the same rows as when it ran every round (accepting nothing).
    schedule = [False] * 7 + [True] * 3 + [False] * 2 + [True] * 2
    deferred = _run(target, head, SpecConfig(method, K, True, 96, 64, plain_rounds=True), schedule[:7])
    every = _run(target, head, SpecConfig(method, K, True, 96, 64), schedule[:7])
    assert deferred.output.tolist() == every.output.tolist()
    assert deferred.num_pending.tolist() != every.num_pending.tolist()  # rows waited
    written = int(jnp.min(deferred.target_cache.lengths - deferred.num_pending))
    for a, b in zip(jax.tree.leaves(deferred.drafter_cache.layers), jax.tree.leaves(every.drafter_cache.layers),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a)[:, :, :written], np.asarray(b)[:, :, :written], rtol=1e-5,
                                   atol=1e-5)
    # the next speculative round drafts from the same rows either way
    full = _run(target, head, SpecConfig(method, K, True, 96, 64, plain_rounds=True), schedule)
    ref = speculative_generate(target, None, PROMPTS, method="none", max_new_tokens=40, eos_token_ids=[-1])
    for i in range(2):
        n = int(full.out_len[i])
        assert full.output[i, :n].tolist() == ref.tokens[i][:n]
    spec_after = _run(target, head, SpecConfig(method, K, True, 96, 64, plain_rounds=True), schedule[:8])
    spec_every = _run(target, head, SpecConfig(method, K, True, 96, 64), schedule[:8])
    assert spec_after.output.tolist() == spec_every.output.tolist()
    np.testing.assert_array_equal(spec_after.accepted_per_pos, spec_every.accepted_per_pos)


def test_plain_rounds_are_for_head_methods_only():
    with pytest.raises(ValueError, match="plain_rounds applies to the head methods"):
        SpecConfig("ngram", 3, True, 96, 64, plain_rounds=True)

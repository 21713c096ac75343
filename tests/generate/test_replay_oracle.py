"""The replay oracle (a published acceptance curve, with or without a real head's drafting
cost) and the gathered MoE path used by the seed-shaped synthetic benchmark."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import slow_except

from benchmarks import common
from peagle_jax.drafters.reference import ReferenceDrafter, conditional_acceptance
from peagle_jax.generate import speculative_generate
from peagle_jax.models import create_model
from peagle_jax.models.options import configure_inference

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10]]
CURVE = [0.8, 0.6, 0.4]


@pytest.fixture(scope="module")
def target():
    return common.tiny_target(128, layers=2, seed=3)


@pytest.fixture(scope="module")
def reference(target):
    return speculative_generate(target, None, PROMPTS, method="none", max_new_tokens=200, eos_token_ids=[])


def test_conditional_acceptance():
    np.testing.assert_allclose(conditional_acceptance(CURVE, 4), [0.8, 0.75, 2 / 3, 0.0], rtol=1e-6)
    np.testing.assert_allclose(conditional_acceptance([1.0, 0.0], 3), [1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="non-increasing"):
        conditional_acceptance([0.5, 0.6], 2)


def test_replayed_curve_is_followed_and_output_exact(target, reference):
    oracle = ReferenceDrafter(np.asarray(reference.tokens), 128, acceptance=CURVE, max_draft=8)
    out = speculative_generate(target, oracle, PROMPTS, method="peagle", num_draft_tokens=3,
                               max_new_tokens=200, eos_token_ids=[])
    assert out.tokens == reference.tokens
    rounds = int(np.sum(out.rounds))
    rates = out.accepted_per_position / rounds
    # ~140 rounds: each rate within a few standard errors of the curve.
    np.testing.assert_allclose(rates, CURVE, atol=0.13)
    assert out.mean_acceptance_length == pytest.approx(1 + sum(CURVE), abs=0.3)


@pytest.mark.parametrize("method", slow_except(["peagle", "eagle3"], fast={"peagle"}))
def test_head_runs_but_oracle_decides(target, reference, method):
    head = common.random_drafter(target, parallel=method == "peagle")
    with_head = ReferenceDrafter(np.asarray(reference.tokens), 128, acceptance=CURVE, head=head)
    bare = ReferenceDrafter(np.asarray(reference.tokens), 128, acceptance=CURVE)
    kw = dict(method=method, num_draft_tokens=3, max_new_tokens=60, eos_token_ids=[])
    a = speculative_generate(target, with_head, PROMPTS, **kw)
    b = speculative_generate(target, bare, PROMPTS, **kw)
    assert a.tokens == b.tokens == [t[:60] for t in reference.tokens]
    np.testing.assert_array_equal(a.accepted_per_position, b.accepted_per_position)  # same hash draws
    # A random head alone would almost never be accepted; the oracle is (curve starts at 0.8).
    assert a.mean_acceptance_length > 1.5


def test_set_schedule_switches_without_new_oracle(target, reference):
    oracle = ReferenceDrafter(np.asarray(reference.tokens), 128)
    kw = dict(method="peagle", num_draft_tokens=3, max_new_tokens=60, eos_token_ids=[])
    perfect = speculative_generate(target, oracle, PROMPTS, **kw)
    oracle.set_schedule(acceptance=[0.0])
    never = speculative_generate(target, oracle, PROMPTS, **kw)
    assert perfect.mean_acceptance_length == pytest.approx(4.0)
    assert never.mean_acceptance_length == pytest.approx(1.0)
    assert never.tokens == perfect.tokens


def _dense_and(impl: str):
    """(config, dense model, the same weights with MoE `impl`, their first layers' MoEs)."""
    cfg = common.shape_config("tiny-moe", layers=2)
    dense = create_model(cfg, seed=4)
    other = configure_inference(create_model(cfg, seed=4), moe=impl)
    moe_d, moe_o = dense.layers[0].mlp, other.layers[0].mlp
    assert moe_o.impl == impl
    return cfg, dense, other, moe_d, moe_o


def test_gathered_moe_matches_dense():
    cfg, dense, gathered, moe_d, moe_g = _dense_and("gathered")
    rng = np.random.default_rng(0)
    for t in (1, 3):  # 1 token takes the gathered path (3*1*2 <= 8 experts), 3 fall back to dense
        x = jnp.asarray(rng.normal(size=(1, t, cfg.hidden_size)), jnp.float32)
        np.testing.assert_allclose(np.asarray(moe_g(x)), np.asarray(moe_d(x)), rtol=1e-5, atol=1e-6)
    x = jnp.asarray(rng.normal(size=(2, 3, cfg.hidden_size)), jnp.float32)
    w, i = jax.lax.top_k(jax.nn.softmax(moe_d.gate(x), axis=-1), moe_d.top_k)
    w = w / w.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(moe_d._routed_only(x, w, i)), np.asarray(moe_d(x)), rtol=1e-5, atol=1e-6)
    # Greedy decoding is unchanged in f32 on this model.
    kw = dict(method="none", max_new_tokens=16, eos_token_ids=[])
    assert (speculative_generate(gathered, None, PROMPTS, **kw).tokens
            == speculative_generate(dense, None, PROMPTS, **kw).tokens)
    with pytest.raises(ValueError, match="MoE"):
        configure_inference(dense, moe="sparse")


def test_grouped_moe_matches_dense():
    # The grouped matmul (jax.lax.ragged_dot over the pairs sorted by expert) against the dense
    # reference, for a decode row, a verify's rows and a batch whose rows share experts.
    cfg, dense, grouped, moe_d, moe_g = _dense_and("grouped")
    rng = np.random.default_rng(1)
    for shape in ((1, 1), (1, 4), (3, 5)):
        x = jnp.asarray(rng.normal(size=(*shape, cfg.hidden_size)), jnp.float32)
        np.testing.assert_allclose(np.asarray(moe_g(x)), np.asarray(moe_d(x)), rtol=1e-5, atol=1e-6)
    kw = dict(method="none", max_new_tokens=16, eos_token_ids=[])
    assert (speculative_generate(grouped, None, PROMPTS, **kw).tokens
            == speculative_generate(dense, None, PROMPTS, **kw).tokens)

"""The target's layers under one scan (models.layer_stack): the same model as the unrolled loop,
exact speculation, and a round program whose size does not grow with depth."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import slow_except
from flax import nnx

from peagle_jax.cache import KVCache, StackedKV
from peagle_jax.drafters import DrafterConfig, create_drafter
from peagle_jax.generate import speculative_generate
from peagle_jax.generate.tree import move_second_chain
from peagle_jax.models import ModelConfig, create_model
from peagle_jax.models.layer_stack import stack_blocker
from peagle_jax.models.options import configure_inference

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def _config(layers: int = 7, **overrides) -> ModelConfig:
    kw = dict(architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, qk_norm=True,
              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return ModelConfig(**(kw | overrides))


def _two_steps(model, kv_cache_dtype=None):
    """A 5-token prefill then a 2-token step of two sequences, with EAGLE-3's taps."""
    tokens = jnp.array([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    first = model(tokens, positions, model.init_cache(2, 16, kv_cache_dtype), return_aux=True)
    second = model(tokens[:, :2] + 1, positions[:, :2] + 5, first.cache, return_aux=True)
    return first, second


@pytest.mark.parametrize("kv_cache_dtype", [None, "float8_e4m3fn"])
def test_scan_computes_what_the_unrolled_loop_computes(kv_cache_dtype):
    unrolled = create_model(_config(), seed=1)
    scanned = configure_inference(create_model(_config(), seed=1), layer_loop="scan")
    assert len(scanned.layers) == 0 and scanned.layer_stack.self_attn.q_proj.kernel.shape == (7, 32, 32)
    ref, got = _two_steps(unrolled, kv_cache_dtype), _two_steps(scanned, kv_cache_dtype)
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_allclose(g.logits, r.logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g.aux_hidden, r.aux_hidden, rtol=1e-5, atol=1e-5)
    cache = got[1].cache
    assert cache.is_stacked and cache.capacity == 16 and cache.layers.k.shape == (2, 7, 2, 16, 8)
    per_layer = np.stack([np.asarray(layer.k, np.float32) for layer in ref[1].cache.layers], axis=1)
    np.testing.assert_allclose(np.asarray(cache.layers.k, np.float32), per_layer, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, ref[1].cache.lengths)


def test_unstacking_restores_every_parameter():
    model = create_model(_config(layers=3), seed=4)
    before = jax.tree.map(np.asarray, nnx.state(model))
    configure_inference(model, layer_loop="scan")
    configure_inference(model, layer_loop="unrolled")
    assert model.layer_stack is None and len(model.layers) == 3
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(model)), before)


@pytest.mark.parametrize("method, k", slow_except([("peagle", 5), ("eagle3", 3)], fast={("peagle", 5)}))
def test_speculation_under_a_scan_equals_plain_greedy(method, k):
    cfg = _config(architecture="llama", qk_norm=False)
    target = configure_inference(create_model(cfg, seed=1), layer_loop="scan")
    drafter = create_drafter(DrafterConfig.for_target(cfg, num_layers=2, parallel_drafting=True, mask_token_id=63), 2)
    plain = speculative_generate(target, None, PROMPTS, method="none", max_new_tokens=20)
    spec = speculative_generate(target, drafter, PROMPTS, method=method, num_draft_tokens=k, max_new_tokens=20)
    assert spec.tokens == plain.tokens
    unrolled = speculative_generate(create_model(cfg, seed=1), None, PROMPTS, method="none", max_new_tokens=20)
    assert plain.tokens == unrolled.tokens  # float32: the same model, no near-ties on these prompts


def _round_hlo_ops(layers: int) -> int:
    """Instructions of the lowered plain decode round of a scanned target at this depth."""
    from peagle_jax.generate.steps import SpecConfig, prefill, spec_round
    from peagle_jax.sampling import SamplingParams

    target = configure_inference(nnx.eval_shape(lambda: create_model(_config(layers=layers), seed=0)),
                                 layer_loop="scan")
    graphdef, state = nnx.split(target)
    config = SpecConfig("none", 0, True, 64, 32)

    def init(st, tokens, lens):
        return prefill(nnx.merge(graphdef, st), None, tokens, lens, config, max_new=jnp.full((1,), 32, jnp.int32),
                       sp=SamplingParams.full(1, 0.0, 0, 1.0), eos_ids=jnp.array([0], jnp.int32),
                       key=jax.random.split(jax.random.key(0), 1))

    abstract = jax.ShapeDtypeStruct
    spec_state = jax.eval_shape(init, state, abstract((1, 8), jnp.int32), abstract((1,), jnp.int32))
    one_round = jax.jit(lambda st, s: spec_round(nnx.merge(graphdef, st), None, s, config))
    text = one_round.lower(state, spec_state).as_text()
    return len(re.findall(r"^\s+(?:%\S+ = )?\"?stablehlo\.", text, re.MULTILINE))


def test_a_scanned_round_program_does_not_grow_with_depth():
    assert _round_hlo_ops(2) == _round_hlo_ops(12) > 0


def test_layers_that_differ_cannot_be_stacked():
    cfg = _config(layers=3, architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  mlp_only_layers=(1,))
    with pytest.raises(ValueError, match="layer 1 differs from layer 0 in structure"):
        configure_inference(create_model(cfg, seed=0), layer_loop="scan")
    drafter = create_drafter(DrafterConfig.for_target(_config(), num_layers=1), 0)
    with pytest.raises(ValueError, match="target model"):
        configure_inference(drafter, layer_loop="scan")
    shapes_differ = create_model(_config(layers=2), seed=0)
    shapes_differ.layers[1].mlp.down_proj.kernel.value = jnp.zeros((64, 32), jnp.bfloat16)  # another dtype
    assert "weights differ from layer 0's in shape or type" in stack_blocker(shapes_differ)
    with pytest.raises(ValueError, match="unknown layer loop"):
        configure_inference(create_model(_config(layers=2), seed=0), layer_loop="while")


def test_scan_on_a_mesh_is_refused_by_the_options():
    from peagle_jax.options import Options

    with pytest.raises(ValueError, match="layer_loop 'scan' does not run on a mesh"):
        Options(layer_loop="scan", mesh="model=2")


def test_a_second_chain_moves_alike_in_a_stacked_cache():
    rng = np.random.default_rng(0)
    per_layer = KVCache.zeros(3, 2, 32, 2, 4)
    per_layer = per_layer.map_layers(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype))
    stacked = KVCache(StackedKV(*jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *per_layer.layers)),
                      per_layer.lengths)
    lengths, count = jnp.array([5, 9]), jnp.array([2, 3])
    moved, moved_stacked = (move_second_chain(c, lengths, 4, 3, count) for c in (per_layer, stacked))
    np.testing.assert_array_equal(np.stack([layer.k for layer in moved.layers], axis=1), moved_stacked.layers.k)
    np.testing.assert_array_equal(np.stack([layer.v for layer in moved.layers], axis=1), moved_stacked.layers.v)

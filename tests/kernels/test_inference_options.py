"""Kernels in the model path, FP8 KV cache and FP8 weights (models.options)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import slow_except
from flax import nnx

from peagle_jax.drafters import DrafterConfig, create_drafter
from peagle_jax.generate import speculative_generate
from peagle_jax.models import ModelConfig, create_model
from peagle_jax.models.options import configure_inference, quantize_weights_fp8

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]


def _pair(seed=1):
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    target = create_model(cfg, seed)
    drafter = create_drafter(
        DrafterConfig.for_target(cfg, num_layers=2, parallel_drafting=True, mask_token_id=63), seed + 1)
    return target, drafter


def _logits(model, tokens):
    t = jnp.asarray([tokens])
    return np.asarray(model(t, jnp.arange(len(tokens))[None], model.init_cache(1, 32)).logits[0])


@pytest.mark.parametrize("method", slow_except(["peagle", "eagle3"], fast={"peagle"}))
def test_triton_kernel_in_model_path_matches_reference(method):
    target, drafter = _pair()
    ref = speculative_generate(target, drafter, PROMPTS, method=method, num_draft_tokens=3, max_new_tokens=10)
    for m in (target, drafter):
        configure_inference(m, attention="triton", interpret=True)
    out = speculative_generate(target, drafter, PROMPTS, method=method, num_draft_tokens=3, max_new_tokens=10)
    assert out.tokens == ref.tokens


def test_fp8_kv_cache_accuracy_and_exactness():
    target, drafter = _pair()
    tokens = list(range(1, 20))
    base = _logits(target, tokens)
    configure_inference(target, kv_cache_dtype="float8_e4m3fn")
    configure_inference(drafter, kv_cache_dtype="float8_e4m3fn")
    cache = target.init_cache(1, 32)
    assert cache.layers[0].k.dtype == jnp.float8_e4m3fn and cache.layers[0].k_scale.shape == (1, 2, 32, 1)
    fp8 = _logits(target, tokens)
    rel = np.abs(fp8 - base).max() / np.abs(base).max()
    assert 0 < rel < 0.05, rel  # quantization really happens, and costs little
    # Speculation stays exact with respect to the same (FP8-cache) target.
    plain = speculative_generate(target, None, PROMPTS, method="none", max_new_tokens=10)
    spec = speculative_generate(target, drafter, PROMPTS, method="peagle", num_draft_tokens=3, max_new_tokens=10)
    assert spec.tokens == plain.tokens


def test_fp8_weights_accuracy():
    target, _ = _pair()
    tokens = list(range(1, 20))
    base = _logits(target, tokens)
    quantize_weights_fp8(target)
    q = target.layers[0].self_attn.q_proj
    assert q.kernel.value.dtype == jnp.float8_e4m3fn and q.kernel_scale.value.shape == (64,)
    fp8 = _logits(target, tokens)
    rel = np.abs(fp8 - base).max() / np.abs(base).max()
    assert 0 < rel < 0.08, rel


def test_bad_options():
    target, _ = _pair()
    with pytest.raises(ValueError, match="attention"):
        configure_inference(target, attention="cuda-magic")
    with pytest.raises(ValueError, match="KV cache dtype"):
        configure_inference(target, kv_cache_dtype="int4")


@pytest.mark.slow
def test_smollm2_speculative_with_triton_kernel_equals_reference():
    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.default_model import default_model_path

    target = load_target(default_model_path())
    drafter = create_drafter(DrafterConfig.for_target(target.config, num_layers=1, parallel_drafting=True,
                                                      mask_token_id=0), 2)
    prompts = [[1, 9038, 2021, 314, 253, 1345, 30, 2], [1, 504, 3458, 282]]
    ref = speculative_generate(target, drafter, prompts, method="peagle", num_draft_tokens=3, max_new_tokens=8)
    for m in (target, drafter):
        configure_inference(m, attention="triton", interpret=True)
    out = speculative_generate(target, drafter, prompts, method="peagle", num_draft_tokens=3, max_new_tokens=8)
    assert out.tokens == ref.tokens


def test_configure_keeps_options_it_is_not_given():
    # Old configure_inference(module, kv_cache_dtype=...) silently reset attention to None.
    from peagle_jax.models.layers import Attention

    target, _ = _pair()
    configure_inference(target, attention="triton", interpret=True)
    configure_inference(target, kv_cache_dtype="bfloat16")
    impls = {n.attn_impl for _, n in nnx.iter_graph(target) if isinstance(n, Attention)}
    assert impls == {"triton"} and target.kv_cache_dtype == "bfloat16"

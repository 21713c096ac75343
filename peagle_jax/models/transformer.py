"""Decoder-only causal LM (llama, qwen2, qwen3, qwen3_moe, gpt_oss) as one Flax NNX module.

The families differ only in switches of `ModelConfig`: q/k/v biases (qwen2), q/k RMSNorm
(qwen3), routed experts (qwen3_moe), rope scaling (llama3, yarn), attention sinks, sliding-window
layers and biased experts with a clamped SwiGLU (gpt_oss). Layers run unrolled (a Python
loop inside jit) or, once `models.layer_stack.stack_layers` has stacked them, under one
`lax.scan` (a compile time and program memory that do not grow with depth).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from peagle_jax import kernels
from peagle_jax.cache import KVCache, shard_cache
from peagle_jax.models.config import ModelConfig
from peagle_jax.models.layer_stack import run_stacked
from peagle_jax.models.layers import FULL_WINDOW, MLP, Attention, MoE, RMSNorm, packed_matmul


class ForwardOutput(NamedTuple):
    logits: Float[Array, "B R V"] | None  # R = T, or the rows picked by `logit_rows`
    cache: KVCache
    aux_hidden: Float[Array, "B T A"] | None  # EAGLE-3 taps, concatenated (A = 3 * D)
    final_hidden: Float[Array, "B T D"] | None  # after the final norm (lm_head input)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(
            cfg.hidden_size, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim,
            qkv_bias=cfg.attention_bias,
            # llama/qwen3 `attention_bias` covers o_proj too; qwen2's q/k/v biases do not
            o_bias=cfg.attention_bias and cfg.architecture != "qwen2",
            qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling, dtype=dtype, rngs=rngs,
            sinks=cfg.attention_sinks, window=cfg.layer_window(layer_idx), windowed=bool(cfg.sliding_layers),
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                           cfg.num_experts_per_tok, cfg.norm_topk_prob, dtype=dtype, rngs=rngs,
                           router=cfg.moe_router, bias=cfg.moe_bias, swiglu_limit=cfg.swiglu_limit,
                           swiglu_alpha=cfg.swiglu_alpha)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, kv, slots=None, skip=None, angles=None):
        h, kv = self.self_attn(self.input_layernorm(x), positions, kv, slots, skip, angles)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv


class CausalLM(nnx.Module):
    """Target LM. `__call__` runs T new tokens per sequence through the KV cache."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.mesh = None  # set by peagle_jax.sharding.shard_module
        self.kv_cache_dtype: str | None = None  # None = the parameter dtype (models.options)
        self.lm_head_packed = nnx.data(None)  # PackedKernel for kernels.matmul (models.options)
        dtype = jnp.dtype(cfg.dtype)
        self.embed_tokens = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.layer_stack = nnx.data(None)  # the layers stacked for a scan (models.layer_stack); then `layers` is empty
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype))

    def init_cache(self, batch_size: int, capacity: int, dtype=None) -> KVCache:
        cfg = self.config
        cache = KVCache.zeros(cfg.num_hidden_layers, batch_size, capacity, cfg.num_key_value_heads,
                              cfg.head_dim, dtype or self.kv_cache_dtype or cfg.dtype,
                              stacked=self.layer_stack is not None)
        return shard_cache(cache, self.mesh)

    def embed(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        return jnp.take(self.embed_tokens[...], tokens, axis=0)

    def lm_head_weight(self) -> Float[Array, "D V"]:
        if self.config.tie_word_embeddings:
            return self.embed_tokens[...].T
        if self.lm_head is None:  # kept only in a GGUF file's blocks (models.options.pack_cpu_matmuls)
            return kernels.unpack_group(self.lm_head_packed[...]).astype(self.config.dtype)
        return self.lm_head[...]

    def logits(self, hidden: Float[Array, "... D"]) -> Float[Array, "... V"]:
        return packed_matmul(hidden, self.lm_head_packed, self.lm_head_weight(), out_dtype=jnp.float32)

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        cache: KVCache,
        *,
        logit_rows: Int[Array, "B R"] | None = None,
        return_aux: bool = False,
        return_final_hidden: bool = False,
        compute_logits: bool = True,
        slots: Int[Array, "B T"] | None = None,
        skip: tuple[Int[Array, "B T"], Int[Array, "B T"]] | None = None,
    ) -> ForwardOutput:
        """Process T tokens at absolute `positions`, writing their K/V into `cache`.

        `logit_rows` picks the rows whose logits are computed (e.g. the last real prompt
        token): the lm_head is a large part of a small model's cost. `slots` and `skip` lay
        out a tree verify (`generate.tree`): the cache rows the K/V go to, when not the
        positions, and the window of rows each query row does not see.
        """
        aux_ids = tuple(self.config.eagle_aux_layer_ids) if return_aux else ()
        x = self.embed(tokens)
        first = self.layers[0] if self.layer_stack is None else self.layer_stack
        angles = first.self_attn.rotary(positions)  # every layer rotates alike
        if self.layer_stack is not None:
            x, stack, tapped = run_stacked(self.layer_stack, x, positions, cache.layers, slots, skip, angles, aux_ids)
            cache, taps = cache._replace(layers=stack), dict(zip(aux_ids, tapped, strict=True))
        else:
            x, cache, taps = self._run_unrolled(x, positions, cache, slots, skip, angles, aux_ids)
        h = self.norm(x)
        logits = None
        if compute_logits:
            sel = h if logit_rows is None else jnp.take_along_axis(h, logit_rows[..., None], axis=1)
            logits = self.logits(sel)
        aux = jnp.concatenate([taps[i] for i in aux_ids], axis=-1) if return_aux else None
        return ForwardOutput(logits=logits, cache=cache, aux_hidden=aux,
                             final_hidden=h if return_final_hidden else None)

    def _run_unrolled(self, x, positions, cache: KVCache, slots, skip, angles, aux_ids: tuple[int, ...]):
        """x through the layers one by one: (x, the cache with their new rows, {i: the residual
        stream entering layer i} for i in `aux_ids`)."""
        taps: dict[int, jax.Array] = {}
        new_layers = []
        for i, layer in enumerate(self.layers):
            if i in aux_ids:
                taps[i] = x
            x, kv = layer(x, positions, cache.layers[i], slots, skip, angles)
            new_layers.append(kv)
        return x, cache._replace(layers=tuple(new_layers)), taps


def abstract_model(cfg: ModelConfig) -> CausalLM:
    """A CausalLM whose parameters are shapes only (`nnx.eval_shape`), for a checkpoint loader
    to fill; its constants, the attention windows, are concrete already."""
    model = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    for i, layer in enumerate(model.layers):
        if layer.self_attn.window is not None:
            window = cfg.layer_window(i)
            layer.self_attn.window.value = jnp.int32(FULL_WINDOW if window is None else window)
    return model


def create_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """A randomly initialised model (tests, benchmarks with synthetic weights)."""
    return CausalLM(cfg, rngs=nnx.Rngs(params=seed))

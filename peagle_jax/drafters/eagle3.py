"""EAGLE-3 draft head with the P-EAGLE parallel-drafting mode (Flax NNX).

Inputs per row: a token and a feature h in drafter space. h is `fc(concat(low, mid, high))`
of the target's three taps for real rows, `fc(mask_hidden)` for P-EAGLE placeholder rows, or
the drafter's own pre-norm output when EAGLE-3 drafts sequentially. Layer 0 attends with
q/k/v over concat(input_layernorm(embed(token)), hidden_norm(h)) (2H wide) and adds the
result to h; later layers are plain pre-norm Llama layers. Logits are over the draft
vocabulary; `d2t` maps a draft id to a target id (target = draft + d2t[draft]).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from peagle_jax.cache import KVCache, shard_cache
from peagle_jax.drafters.config import DrafterConfig
from peagle_jax.drafters.drafting import DraftSettings, Pending, Proposal, draft_parallel, draft_sequential
from peagle_jax.models.layers import MLP, Attention, Linear, RMSNorm, packed_matmul


class VocabMap(nnx.Variable):
    """Non-trainable integer buffers (d2t)."""


class DrafterOutput(NamedTuple):
    logits: Float[Array, "B K Vd"]  # at the requested rows
    prenorm: Float[Array, "B R H"]  # last layer's residual stream (fed back by EAGLE-3)
    cache: KVCache


class DrafterLayer(nnx.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        h = cfg.hidden_size
        self.first = layer_idx == 0
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        if self.first:
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(
            2 * h if self.first else h, h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            qkv_bias=False, o_bias=False, qk_norm=False, eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, dtype=dtype, rngs=rngs,
        )
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(h, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def attention_input(
        self, x: Float[Array, "B R H"], embeds: Float[Array, "B R H"] | None
    ) -> tuple[Float[Array, "B R A"], Float[Array, "B R H"]]:
        """(attention input, residual): layer 0 attends over [norm(embed) | norm(feature)]."""
        if self.first:
            hn = self.hidden_norm(x)
            attn_in = jnp.concatenate([self.input_layernorm(embeds), hn], axis=-1)
            return attn_in, (hn if self.norm_before_residual else x)
        return self.input_layernorm(x), x

    def finish(self, residual: Float[Array, "B R H"], attn_out: Float[Array, "B R H"]) -> Float[Array, "B R H"]:
        """Residual add, then the MLP block (attn_out already through o_proj)."""
        x = residual + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, x, positions, kv, embeds=None, angles=None):
        attn_in, residual = self.attention_input(x, embeds)
        a, kv = self.self_attn(attn_in, positions, kv, angles=angles)
        return self.finish(residual, a), kv


class Eagle3Drafter(nnx.Module):
    """The EAGLE-3 head; with `parallel_drafting` also the P-EAGLE one (a `Proposer`)."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.mesh = None  # set by peagle_jax.sharding.shard_module
        self.kv_cache_dtype: str | None = None  # None = the parameter dtype (models.options)
        #: Also propose the first draft's runner-up as a second chain in greedy rounds
        #: (`drafting.second_choice`); `peagle_jax.load(second_root=True)` sets it.
        self.second_root = False
        #: Verify only the leading drafts whose product of top-1 head probabilities is >= this
        #: (`drafting.confident_drafts`; 0: all K); `peagle_jax.load(draft_cutoff=...)` sets it.
        self.draft_cutoff = 0.0
        dtype = jnp.dtype(cfg.dtype)
        self.embed_tokens = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))
        self.fc = Linear(cfg.fc_in_features, cfg.hidden_size, bias=False, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DrafterLayer(cfg, i, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (cfg.hidden_size, cfg.draft_vocab_size), dtype))
        self.lm_head_packed = nnx.data(None)  # PackedKernel for kernels.matmul (models.options)
        self.d2t = VocabMap(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))
        # Placeholder feature for parallel-drafting slots, in the pre-fc (3 * H_t) space.
        self.mask_hidden = (
            nnx.Param(jax.random.normal(rngs.params(), (cfg.fc_in_features,), dtype))
            if cfg.parallel_drafting else None
        )

    def init_cache(self, batch_size: int, capacity: int, dtype=None) -> KVCache:
        cfg = self.config
        cache = KVCache.zeros(cfg.num_hidden_layers, batch_size, capacity, cfg.num_key_value_heads,
                              cfg.head_dim, dtype or self.kv_cache_dtype or cfg.dtype)
        return shard_cache(cache, self.mesh)

    uses_features = True  # drafts from the target's feature taps

    def project(self, aux: Float[Array, "... A"]) -> Float[Array, "... H"]:
        """Target taps (concatenated) -> drafter feature space."""
        kernel = self.fc.kernel  # None where group-packed weights are the only copy (models.options)
        return self.fc(aux.astype(self.config.dtype if kernel is None else kernel.dtype))

    @property
    def feature_spec(self) -> jax.ShapeDtypeStruct:
        """Width and dtype of `project`'s output: the features pending rows carry."""
        out = jax.eval_shape(self.project, jax.ShapeDtypeStruct((1, self.config.fc_in_features), self.config.dtype))
        return jax.ShapeDtypeStruct(out.shape[-1:], out.dtype)

    @property
    def can_draft_parallel(self) -> bool:
        return self.config.mask_token_id is not None and self.mask_hidden is not None

    def prefill(self, cache: KVCache, tokens: Int[Array, "B T"], feats: Float[Array, "B T H"],
                positions: Int[Array, "B T"]) -> KVCache:
        """`cache` with the prompt rows (token p+1 with the feature of position p) written in."""
        return self(tokens, feats, positions, cache, logit_rows=jnp.zeros((tokens.shape[0], 1), jnp.int32)).cache

    def propose(self, cache: KVCache, pending: Pending, settings: DraftSettings) -> Proposal:
        """K drafts: one parallel forward (P-EAGLE) or K sequential ones (EAGLE-3)."""
        if settings.parallel and self.mask_hidden is None:
            raise ValueError("P-EAGLE drafting needs a head built for parallel drafting (mask_hidden)")
        if self.second_root and self.draft_cutoff > 0:
            raise ValueError("second_root and draft_cutoff do not combine: a second chain is verified at the "
                             "full width K, so the cutoff would only drop accepted drafts; choose one")
        draft = draft_parallel if settings.parallel else draft_sequential
        return draft(self, cache, pending, settings, second_root=self.second_root, cutoff=float(self.draft_cutoff))

    def mask_feature(self) -> Float[Array, " H"]:
        if self.mask_hidden is None:
            raise ValueError("this drafter has no mask_hidden: it was not built for parallel drafting")
        return self.fc(self.mask_hidden[...])

    def to_target_ids(self, draft_ids: Int[Array, "..."]) -> Int[Array, "..."]:
        return draft_ids + jnp.take(self.d2t[...], draft_ids)

    def lm_head_weight(self) -> Float[Array, "H Vd"]:
        return self.lm_head[...]

    def logits_from_prenorm(self, prenorm: Float[Array, "... H"]) -> Float[Array, "... Vd"]:
        weight = None if self.lm_head is None else self.lm_head[...]  # None: only the packed copy (g4)
        return packed_matmul(self.norm(prenorm), self.lm_head_packed, weight, out_dtype=jnp.float32)

    def __call__(
        self,
        tokens: Int[Array, "B R"],
        features: Float[Array, "B R H"],
        positions: Int[Array, "B R"],
        cache: KVCache,
        *,
        logit_rows: Int[Array, "B K"] | None = None,
    ) -> DrafterOutput:
        """One drafter forward over R rows (features already in drafter space)."""
        embeds = jnp.take(self.embed_tokens[...], tokens, axis=0)
        x = features.astype(embeds.dtype)
        new_layers = []
        angles = self.layers[0].self_attn.rotary(positions)  # shared by the layers
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, positions, cache.layers[i], embeds if i == 0 else None, angles)
            new_layers.append(kv)
        sel = x if logit_rows is None else jnp.take_along_axis(x, logit_rows[..., None], axis=1)
        return DrafterOutput(self.logits_from_prenorm(sel), x, cache._replace(layers=tuple(new_layers)))


def create_drafter(cfg: DrafterConfig, seed: int = 0) -> Eagle3Drafter:
    return Eagle3Drafter(cfg, rngs=nnx.Rngs(params=seed))

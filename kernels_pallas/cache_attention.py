"""Multi-query cache attention: T query rows per sequence against its KV cache.

Layout (shared with `peagle_jax.cache`):
  q            [B, T, H, D]     query rows of this step (already rotary-embedded)
  k, v cache   [B, S, KVH, D]   row s holds the key/value of absolute position s
  q_positions  [B, T]           absolute position of each query row

Query row (b, t) attends to cache rows s <= q_positions[b, t]. Rows above a sequence's
committed length are never read by a query below them, so stale rows (rejected drafts,
placeholder slots, prompt padding) need no clearing: causality by absolute position is the
whole mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def cache_attention_reference(
    q: Float[Array, "B T H D"],
    k_cache: Float[Array, "B S KVH D"],
    v_cache: Float[Array, "B S KVH D"],
    q_positions: Int[Array, "B T"],
    *,
    k_scale: Float[Array, "..."] | None = None,
    v_scale: Float[Array, "..."] | None = None,
    sm_scale: float | None = None,
) -> Float[Array, "B T H D"]:
    """XLA reference: dense scores over the whole cache, fp32 softmax, GQA by reshaping."""
    b, t, h, d = q.shape
    kvh = k_cache.shape[2]
    group = h // kvh
    if sm_scale is None:
        sm_scale = 1.0 / float(d) ** 0.5
    k = k_cache.astype(jnp.float32)
    v = v_cache.astype(jnp.float32)
    if k_scale is not None:  # FP8 cache: dequantize with per-head or per-token scales
        k = k * k_scale.astype(jnp.float32)
    if v_scale is not None:
        v = v * v_scale.astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(b, t, kvh, group, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k) * sm_scale
    key_idx = jnp.arange(k_cache.shape[1])
    mask = key_idx[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, d).astype(q.dtype)


def cache_attention(
    q: Float[Array, "B T H D"],
    k_cache: Float[Array, "B S KVH D"],
    v_cache: Float[Array, "B S KVH D"],
    q_positions: Int[Array, "B T"],
    *,
    k_scale: Float[Array, "..."] | None = None,
    v_scale: Float[Array, "..."] | None = None,
    sm_scale: float | None = None,
    implementation: str | None = None,
) -> Float[Array, "B T H D"]:
    """Dispatch to an implementation; ``None`` or ``"xla"`` is the reference."""
    if implementation in (None, "xla"):
        return cache_attention_reference(
            q, k_cache, v_cache, q_positions, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale
        )
    raise ValueError(f"unknown cache_attention implementation {implementation!r}; known: 'xla'")

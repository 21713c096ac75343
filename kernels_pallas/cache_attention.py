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

import logging

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

#: Query blocks up to this many rows (decode, verify, drafter steps) are attended row by row.
ROWWISE_MAX_ROWS = 16


def cache_attention_reference(
    q: Float[Array, "B T H D"],
    k_cache: Float[Array, "B S KVH D"],
    v_cache: Float[Array, "B S KVH D"],
    q_positions: Int[Array, "B T"],
    *,
    k_scale: Float[Array, "..."] | None = None,
    v_scale: Float[Array, "..."] | None = None,
    sm_scale: float | None = None,
    rowwise: bool | None = None,
) -> Float[Array, "B T H D"]:
    """XLA reference: dense scores over the whole cache, fp32 softmax, GQA by reshaping.

    ``rowwise`` (default: T <= ROWWISE_MAX_ROWS) attends one query row at a time, so every row
    is computed by the same [G, D] x [D, S] products whatever T is. XLA:CPU picks its f32 dot
    algorithm from the row count M = T * G, so a batched dot gives a row slightly different
    values in a 1-row decode step and in a K+1-row verify; in bf16 those differences flip
    near-tie argmaxes and break the promise that greedy speculative decoding emits exactly
    the tokens of plain decoding. Long blocks (prefill) stay batched: both modes share them.
    """
    if rowwise is None:
        rowwise = q.shape[1] <= ROWWISE_MAX_ROWS
    k = k_cache.astype(jnp.float32)
    v = v_cache.astype(jnp.float32)
    if k_scale is not None:  # FP8 cache: dequantize with per-head or per-token scales
        k = k * k_scale.astype(jnp.float32)
    if v_scale is not None:
        v = v * v_scale.astype(jnp.float32)
    if sm_scale is None:
        sm_scale = 1.0 / float(q.shape[-1]) ** 0.5
    if not rowwise:
        return _attend(q, k, v, q_positions, sm_scale)

    # Unrolled (T is small): measured faster on XLA:CPU than a lax.map over the rows.
    rows = [_attend(q[:, t:t + 1], k, v, q_positions[:, t:t + 1], sm_scale) for t in range(q.shape[1])]
    return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1)


def _attend(
    q: Float[Array, "B T H D"], k: Float[Array, "B S KVH D"], v: Float[Array, "B S KVH D"],
    q_positions: Int[Array, "B T"], sm_scale: float,
) -> Float[Array, "B T H D"]:
    """Causal-by-position attention of T rows to fp32 K/V (GQA by reshaping)."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k) * sm_scale
    key_idx = jnp.arange(k.shape[1])
    mask = key_idx[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, d).astype(q.dtype)


IMPLEMENTATIONS = ("xla", "triton", "mosaic", "auto")


def _gpu_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the default GPU, or None when the default backend is not a CUDA GPU."""
    try:
        if jax.default_backend() != "gpu":
            return None
        dev = jax.devices()[0]
        cc = getattr(dev, "compute_capability", None)
        if cc is None:
            return None
        major, _, minor = str(cc).partition(".")
        return int(major), int(minor or 0)
    except Exception:  # noqa: BLE001 - any failure means "not a usable CUDA GPU"
        return None


def resolve_implementation(
    implementation: str | None,
    *,
    q_dtype=jnp.bfloat16,
    kv_dtype=jnp.bfloat16,
    head_dim: int = 128,
    seq_len: int | None = None,
    interpret: bool = False,
) -> str:
    """The implementation `cache_attention` will run: "xla", "triton" or "mosaic".

    * None / "xla": the XLA reference.
    * "auto": on a CUDA GPU, "mosaic" on sm_90+ when it supports the dtypes / head_dim, else
      "triton"; anywhere else "xla" (auto never picks interpret mode).
    * "triton" / "mosaic": that Pallas kernel on a CUDA GPU, or in interpret mode when
      ``interpret=True``; without a GPU and without ``interpret=True`` it falls back to "xla".
      "mosaic" on a pre-Hopper GPU or with inputs it does not support falls back to "triton".
    Every fallback is logged once (logger "kernels_pallas").
    """
    from kernels_pallas import cache_attention_mosaic as _mosaic
    from kernels_pallas import cache_attention_triton as _triton
    from kernels_pallas._common import log_once

    impl = "xla" if implementation is None else implementation
    if impl not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown cache_attention implementation {implementation!r}; "
            f"known: {', '.join(repr(i) for i in IMPLEMENTATIONS)}"
        )
    if impl == "xla":
        return "xla"
    cc = _gpu_compute_capability()
    mosaic_why = _mosaic.supports(q_dtype, kv_dtype, head_dim, seq_len)
    triton_why = _triton.supports(q_dtype, kv_dtype, head_dim)
    if impl == "auto":
        if cc is None:
            log_once(
                "auto-no-gpu",
                "cache_attention(implementation='auto'): no CUDA GPU (backend %r); using 'xla'",
                jax.default_backend(),
                level=logging.INFO,
            )
            return "xla"
        if cc >= (9, 0) and mosaic_why is None:
            return "mosaic"
        if triton_why is not None:
            log_once(
                f"auto-xla-{triton_why}",
                "cache_attention(implementation='auto'): no Pallas kernel supports %s; using "
                "'xla'",
                triton_why,
                level=logging.INFO,
            )
            return "xla"
        log_once(
            f"auto-triton-{cc}-{mosaic_why}",
            "cache_attention(implementation='auto'): using 'triton' (mosaic: %s)",
            f"GPU sm_{cc[0]}{cc[1]} < sm_90" if cc < (9, 0) else mosaic_why,
            level=logging.INFO,
        )
        return "triton"
    if cc is None and not interpret:
        log_once(
            f"{impl}-no-gpu",
            "cache_attention(implementation=%r): no CUDA GPU (backend %r) and interpret=False; "
            "falling back to 'xla' (pass interpret=True to run the Pallas kernel in interpret "
            "mode)",
            impl,
            jax.default_backend(),
        )
        return "xla"
    if impl == "mosaic":
        why = mosaic_why
        if why is None and cc is not None and cc < (9, 0) and not interpret:
            why = f"GPU sm_{cc[0]}{cc[1]} < sm_90"
        if why is None and interpret and not _mosaic.interpreter_available():
            why = "this jax has no Mosaic GPU interpreter"
        if why is not None:
            log_once(
                f"mosaic-fallback-{why}",
                "cache_attention(implementation='mosaic'): unsupported (%s); falling back to "
                "'triton'",
                why,
            )
            impl = "triton"
    if impl == "triton" and triton_why is not None:
        log_once(
            f"triton-fallback-{triton_why}",
            "cache_attention(implementation=%r): the Triton kernel does not support %s; "
            "falling back to 'xla'",
            implementation,
            triton_why,
        )
        return "xla"
    return impl


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
    interpret: bool = False,
) -> Float[Array, "B T H D"]:
    """Dispatch to an implementation; ``None`` or ``"xla"`` is the reference.

    ``implementation``: "xla" | "triton" | "mosaic" | "auto" (see `resolve_implementation`);
    ``interpret=True`` runs a requested Pallas kernel in interpret mode (CPU tests).
    The choice is made at trace time from the default backend and the input dtypes.
    """
    impl = resolve_implementation(
        implementation,
        q_dtype=q.dtype,
        kv_dtype=k_cache.dtype,
        head_dim=q.shape[-1],
        seq_len=k_cache.shape[1],
        interpret=interpret,
    )
    if impl == "xla":
        return cache_attention_reference(
            q, k_cache, v_cache, q_positions, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale
        )
    if impl == "triton":
        from kernels_pallas.cache_attention_triton import cache_attention_triton

        return cache_attention_triton(
            q, k_cache, v_cache, q_positions, k_scale=k_scale, v_scale=v_scale,
            sm_scale=sm_scale, interpret=interpret,
        )
    from kernels_pallas.cache_attention_mosaic import cache_attention_mosaic

    return cache_attention_mosaic(
        q, k_cache, v_cache, q_positions, k_scale=k_scale, v_scale=v_scale,
        sm_scale=sm_scale, interpret=interpret,
    )

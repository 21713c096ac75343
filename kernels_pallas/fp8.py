"""FP8 (float8_e4m3fn) storage for the KV cache: amax-scaled quantize / dequantize.

Layout follows `kernels_pallas.cache_attention`: a K or V cache is ``[B, KVH, S, D]``.

Two scale granularities:

* ``"per_token"``: one scale per (sequence, kv head, position): scale ``[B, KVH, S, 1]``.
  Each row of ``D`` values is scaled so that its largest magnitude maps to 448, the largest
  finite e4m3fn value. Best accuracy; scales cost ``4 / D`` bytes per stored element.
* ``"per_head"``: one scale per kv head over the whole tensor: scale ``[1, KVH, 1, 1]``.

The dequantized value is ``x_fp8.astype(f32) * scale`` (this is what
`cache_attention_reference` does with ``k_scale`` / ``v_scale``). e4m3fn has 3 mantissa bits, so
the round-trip error of a normal value is at most ``2**-4`` relative (half an ulp); values
below the smallest normal (``2**-6 * scale``) have absolute error at most ``2**-10 * scale``.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TINY = 1e-12  # floor on amax so an all-zero row gets a finite scale

Granularity = Literal["per_token", "per_head"]


def compute_scale(x: jax.Array, granularity: Granularity = "per_token") -> jax.Array:
    """amax / 448 scale of a ``[B, KVH, S, D]`` tensor (or rows ``[B, T, KVH, D]`` per token), in float32."""
    if x.ndim != 4:
        raise ValueError(f"expected a [B, KVH, S, D] tensor, got shape {x.shape}")
    ax = jnp.abs(x.astype(jnp.float32))
    if granularity == "per_token":
        amax = jnp.max(ax, axis=-1, keepdims=True)  # [B, KVH, S, 1]
    elif granularity == "per_head":
        amax = jnp.max(ax, axis=(0, 2, 3), keepdims=True)  # [1, KVH, 1, 1]
    else:
        raise ValueError(f"unknown granularity {granularity!r}; known: 'per_token', 'per_head'")
    return jnp.maximum(amax, _TINY) / FP8_MAX


def quantize_with_scale(x: jax.Array, scale: jax.Array) -> jax.Array:
    """Quantize with a given (broadcastable) scale; values are clipped to +-448."""
    y = x.astype(jnp.float32) / scale.astype(jnp.float32)
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def quantize_kv(
    x: jax.Array, granularity: Granularity = "per_token"
) -> tuple[jax.Array, jax.Array]:
    """Quantize a ``[B, KVH, S, D]`` K or V tensor to float8_e4m3fn.

    Returns ``(x_fp8, scale)`` with scale ``[B, KVH, S, 1]`` ("per_token") or
    ``[1, KVH, 1, 1]`` ("per_head"), float32, such that ``dequantize(x_fp8, scale)`` ~ ``x``.
    """
    scale = compute_scale(x, granularity)
    return quantize_with_scale(x, scale), scale


def dequantize(x_fp8: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``x_fp8 * scale`` computed in float32, cast to ``dtype``."""
    return (x_fp8.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def scale_granularity(scale: jax.Array | None, b: int, s: int, kvh: int) -> str | None:
    """Classify a scale array for a ``[B, KVH, S, D]`` cache: None / "per_head" / "per_token".

    "per_head" is any shape that broadcasts to ``[1, KVH, 1, 1]`` (a scalar too);
    "per_token" is any shape that broadcasts to ``[B, KVH, S, 1]`` and varies over B or S.
    """
    if scale is None:
        return None
    shape = tuple(scale.shape)
    if len(shape) > 4:
        raise ValueError(f"scale of rank {len(shape)} > 4: {shape}")
    shape = (1,) * (4 - len(shape)) + shape
    if shape[3] != 1:
        raise ValueError(f"scale must have a trailing dimension of 1, got {scale.shape}")
    for got, full in zip(shape[:3], (b, kvh, s), strict=True):
        if got not in (1, full):
            raise ValueError(f"scale shape {scale.shape} does not broadcast to {(b, kvh, s, 1)}")
    if shape[0] == 1 and shape[2] == 1:
        return "per_head"
    return "per_token"

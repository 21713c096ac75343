"""Shared wrapper-side plumbing for the Pallas cache-attention kernels.

Both GPU kernels work on "row-major GQA groups": for one (batch, kv head) the ``T * G`` query
rows that share the kv head are laid out as one ``[M, D]`` matrix, row ``r = t * G + g``
(query row ``t``, head ``kvh * G + g``), padded with zero rows to ``M_pad``. Every row carries
its own absolute position, so the causal mask is ``key_index <= row_position`` and the
ragged / per-row case needs no special handling. Padding rows get position 0 (they attend to
key 0 only, so they never produce NaNs) and are dropped by `rows_to_heads`.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from kernels_pallas.fp8 import scale_granularity

logger = logging.getLogger("kernels_pallas")

_logged: set[str] = set()


def log_once(key: str, msg: str, *args, level: int = logging.WARNING) -> None:
    """Log a message once per process per ``key`` (fallbacks must be visible but not spammy)."""
    if key in _logged:
        return
    _logged.add(key)
    logger.log(level, msg, *args)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def heads_to_rows(q: jax.Array, kvh: int, m_pad: int) -> jax.Array:
    """``[B, T, H, D]`` -> ``[B, KVH, M_pad, D]`` with row ``t * G + g``; zero padding rows."""
    b, t, h, d = q.shape
    g = h // kvh
    qr = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * g, d)
    if m_pad > t * g:
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, m_pad - t * g), (0, 0)))
    return qr


def rows_to_heads(o: jax.Array, t: int, g: int) -> jax.Array:
    """Inverse of `heads_to_rows`: ``[B, KVH, M_pad, D]`` -> ``[B, T, H, D]``."""
    b, kvh, _, d = o.shape
    o = o[:, :, : t * g].reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4)
    return o.reshape(b, t, kvh * g, d)


def row_positions(q_positions: jax.Array, g: int, m_pad: int, s: int) -> jax.Array:
    """``[B, T]`` -> ``[B, M_pad]`` int32 position per row (padding rows: 0), clipped to S-1.

    Clipping to ``S - 1`` matches the reference, where a position >= S sees the whole cache.
    Negative positions (which see nothing in the reference, giving NaN there) are clipped to
    -1: the kernels then return 0 for that row instead of NaN.
    """
    pos = jnp.repeat(q_positions.astype(jnp.int32), g, axis=1)
    pos = jnp.clip(pos, -1, s - 1)
    if m_pad > pos.shape[1]:
        pos = jnp.pad(pos, ((0, 0), (0, m_pad - pos.shape[1])))
    return pos


def skip_rows(bound: jax.Array, g: int, m_pad: int) -> jax.Array:
    """A tree mask bound ``[B, T]`` -> ``[B, M_pad]`` int32 per kernel row (padding rows: 0)."""
    rows = jnp.repeat(bound.astype(jnp.int32), g, axis=1)
    if m_pad > rows.shape[1]:
        rows = jnp.pad(rows, ((0, 0), (0, m_pad - rows.shape[1])))
    return rows


def prepare_scales(k_scale, v_scale, b: int, s: int, kvh: int):
    """Normalize k/v scales to the kernel layouts.

    Returns ``(mode, k_s, v_s)`` with mode None (no scales), "per_head" (k_s, v_s: ``[KVH]``
    float32) or "per_token" (k_s, v_s: ``[B, KVH, S]`` float32). A missing one of the pair is
    filled with ones in the other's layout.
    """
    gk = scale_granularity(k_scale, b, s, kvh)
    gv = scale_granularity(v_scale, b, s, kvh)
    if gk is None and gv is None:
        return None, None, None
    mode = "per_token" if "per_token" in (gk, gv) else "per_head"

    def norm(x):
        if x is None:
            x = jnp.ones((1, 1, 1, 1), jnp.float32)
        x = x.astype(jnp.float32)
        x = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
        if mode == "per_head":
            return jnp.broadcast_to(x, (1, kvh, 1, 1)).reshape(kvh)
        return jnp.broadcast_to(x, (b, kvh, s, 1)).reshape(b, kvh, s)

    return mode, norm(k_scale), norm(v_scale)


def default_sm_scale(d: int, sm_scale: float | None) -> float:
    return 1.0 / float(d) ** 0.5 if sm_scale is None else float(sm_scale)


def combine_splits(o, m, denom, out_dtype):
    """Merge split-K partials: o ``[..., P, M, D]`` (unnormalized), m (row max) / denom (softmax
    denominator) ``[..., P, M]``."""
    m_max = jnp.max(m, axis=-2, keepdims=True)
    w = jnp.exp(m - m_max)  # empty splits have m = -1e30 -> weight 0
    l_tot = jnp.sum(w * denom, axis=-2)
    o_tot = jnp.sum(w[..., None] * o, axis=-3)
    l_tot = jnp.where(l_tot > 0, l_tot, 1.0)
    return (o_tot / l_tot[..., None]).astype(out_dtype)


TARGET_PROGRAMS = 264  # ~2 waves on a 132-SM H100/H200
MIN_KEYS_PER_SPLIT = 256


def choose_num_splits(b: int, kvh: int, n_qblocks: int, s: int) -> int:
    """Split the key range when (batch x kv head x query block) programs underfill the GPU."""
    programs = b * kvh * n_qblocks
    if programs >= TARGET_PROGRAMS // 2:
        return 1
    want = -(-TARGET_PROGRAMS // programs)
    return int(max(1, min(want, s // MIN_KEYS_PER_SPLIT)))

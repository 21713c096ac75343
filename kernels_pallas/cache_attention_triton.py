"""Cache attention as a Pallas kernel lowered through Triton (GPU) or interpreted (CPU).

Same contract as `kernels_pallas.cache_attention.cache_attention_reference`:
q ``[B, T, H, D]``, k/v cache ``[B, KVH, S, D]`` (row s = absolute position s),
q_positions ``[B, T]``; query row (b, t) attends to cache rows ``s <= q_positions[b, t]``,
except the rows ``skip_lo[b, t] <= s < skip_hi[b, t]`` when a tree mask is given.

Kernel structure (one program per (batch, kv head, query block, kv split)):

* The ``T * G`` query rows of the ``G`` heads that share one kv head form one ``[M, D]`` tile
  (see `kernels_pallas._common`), so every K/V block loaded from HBM is reused by all of
  them (GQA reuse). ``M`` is padded to a power of two >= 16 (Triton's dot minimum) and capped at
  ``block_m``; larger ``T * G`` adds query blocks to the grid.
* The program loops over key blocks only up to ``max(row positions of this query block)``, i.e.
  the sequence's committed length, not the cache capacity ``S``. Each row is masked by its own
  absolute position. Online softmax in float32 (flash attention), float32 accumulation.
* K/V may be float32, bfloat16, float16 or float8_e4m3fn. FP8 blocks are upcast in registers to
  the query dtype (exact: every e4m3 value is representable in bf16/f16/f32); scales are applied
  to the *scores* (k scale: column scaling of ``q @ k.T``) and to the *probabilities*
  (v scale: column scaling of ``p`` before ``p @ v``), which is exactly
  ``q @ (k * s_k).T`` and ``p @ (v * s_v)`` without materializing a dequantized tile.
  Per-head scales are scalars per program and are folded into the softmax scale / output.
* Split-K ("flash decoding"): with few (batch, kv head) programs and a long cache the key range
  up to the max position is split over ``num_splits`` programs; partial ``(o, m, l)`` are
  merged in XLA (`combine_splits`). ``num_splits=None`` picks a value from the grid size.

Triton-Pallas is deprecated from jax 0.11 (it warns) but still lowers with
``compiler_params=jax.experimental.pallas.triton.CompilerParams()``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas._common import (
    choose_num_splits,
    combine_splits,
    default_sm_scale,
    heads_to_rows,
    next_pow2,
    prepare_scales,
    row_positions,
    rows_to_heads,
    skip_rows,
)

_NEG_INIT = -1e30  # finite running-max init: fully masked blocks never produce NaN


def _kernel(
    *refs,
    sm_scale: float,
    block_k: int,
    num_splits: int,
    seq_len: int,
    scale_mode: str | None,
    compute_dtype,
    precision,
    skip: bool,
    stacked: bool = False,
):
    q_ref, k_ref, v_ref, pos_ref, *refs = refs
    # stacked: the refs hold every layer of this (sequence, kv head); one indexer reads a block of
    # the one layer in place (Triton's lowering takes a single indexer per load)
    at = ()
    if stacked:
        layer_ref, *refs = refs
        at = (layer_ref[0],)
    lo_ref = hi_ref = ks_ref = vs_ref = None
    if skip:
        lo_ref, hi_ref, *refs = refs
    if scale_mode is not None:
        ks_ref, vs_ref, *refs = refs
    out_refs = refs
    split = pl.program_id(3)

    q = q_ref[...]  # [BM, D]
    pos = pos_ref[...]  # [BM] int32
    block_m = q.shape[0]
    head_dim = q.shape[1]
    if q.dtype != compute_dtype:
        q = q.astype(compute_dtype)

    qk_scale = sm_scale
    if scale_mode == "per_head":
        qk_scale = ks_ref[...].astype(jnp.float32) * sm_scale  # scalar

    # Key blocks needed by this query block: [0, n_blocks); this split takes an even share.
    max_pos = jnp.minimum(jnp.max(pos), seq_len - 1)
    n_blocks = lax.div(max_pos + block_k, block_k)  # cdiv(max_pos + 1, block_k), >= 0
    if num_splits == 1:
        lo, hi = 0, n_blocks
    else:
        per = lax.div(n_blocks + (num_splits - 1), num_splits)
        lo = jnp.minimum(split * per, n_blocks)
        hi = jnp.minimum(lo + per, n_blocks)

    col = lax.broadcasted_iota(jnp.int32, (block_m, block_k), 1)
    pos2 = pos[:, None]
    if skip:  # the tree mask: each row's hidden window [lo, hi)
        lo2, hi2 = lo_ref[...][:, None], hi_ref[...][:, None]

    def body(j, carry):
        acc, m_prev, l_prev = carry
        start = pl.multiple_of(j * block_k, block_k)
        kslice = pl.ds(start, block_k)
        k = k_ref[(*at, kslice, slice(None))]
        if k.dtype != compute_dtype:
            k = k.astype(compute_dtype)
        s = pltriton.dot(q, k, trans_b=True, precision=precision)  # [BM, BK] f32
        if scale_mode == "per_token":
            s = s * (ks_ref[kslice].astype(jnp.float32) * sm_scale)[None, :]
        else:
            s = s * qk_scale
        mask = (col + start) <= pos2
        if skip:
            mask = mask & ~(((col + start) >= lo2) & ((col + start) < hi2))
        s = jnp.where(mask, s, -jnp.inf)
        m_cur = jnp.max(s, axis=1)
        m_next = jnp.maximum(m_prev, m_cur)
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        if scale_mode == "per_token":
            p = p * vs_ref[kslice].astype(jnp.float32)[None, :]
        v = v_ref[(*at, kslice, slice(None))]
        if v.dtype != compute_dtype:
            v = v.astype(compute_dtype)
        pv = pltriton.dot(p.astype(compute_dtype), v, precision=precision)
        acc = acc * alpha[:, None] + pv
        return acc, m_next, l_next

    acc0 = jnp.zeros((block_m, head_dim), jnp.float32)
    m0 = jnp.full((block_m,), _NEG_INIT, jnp.float32)
    l0 = jnp.zeros((block_m,), jnp.float32)
    acc, m_i, l_i = lax.fori_loop(lo, hi, body, (acc0, m0, l0))

    if scale_mode == "per_head":
        acc = acc * vs_ref[...].astype(jnp.float32)
    if num_splits == 1:
        (o_ref,) = out_refs
        l_safe = jnp.where(l_i > 0.0, l_i, 1.0)
        o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = acc
        m_ref[...] = m_i
        l_ref[...] = l_i


def supports(q_dtype, kv_dtype, head_dim: int) -> str | None:
    """None if this kernel handles the combination, else the reason it does not."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} (needs a power of two >= 16)"
    for name, dt in (("q", q_dtype), ("kv", kv_dtype)):
        if not jnp.issubdtype(jnp.dtype(dt), jnp.floating):
            return f"{name} dtype {jnp.dtype(dt)}"
    return None


def cache_attention_triton(
    q,
    k_cache,
    v_cache,
    q_positions,
    *,
    k_scale=None,
    v_scale=None,
    sm_scale: float | None = None,
    skip_lo=None,
    skip_hi=None,
    interpret: bool = False,
    block_m: int = 64,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    layer=None,
):
    """Pallas (Triton lowering) cache attention; see the module docstring. ``layer``: the caches
    are a scanned target's stacks [B, L, KVH, S, D] and the kernel reads that layer in place (no
    slice of the stack is copied out; unscaled caches whose S is a multiple of 16)."""
    stacked = layer is not None
    b, t, h, d = q.shape
    kvh, s, dk = k_cache.shape[-3:]
    if stacked:
        if k_scale is not None or v_scale is not None or s % 16:
            raise ValueError("a layer of stacked caches is read in place only without scales and with S % 16 == 0")
        num_layers = k_cache.shape[1]
    if dk != d or v_cache.shape != k_cache.shape or k_cache.shape[0] != b:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    if h % kvh:
        raise ValueError(f"num heads {h} not a multiple of kv heads {kvh}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 for Triton, got {d}")
    g = h // kvh
    sm_scale = default_sm_scale(d, sm_scale)

    rows = t * g
    bm = max(16, min(next_pow2(block_m), next_pow2(rows)))
    n_q = -(-rows // bm)
    m_pad = n_q * bm

    # Key block: a power of two that divides S (so no block reads past the cache).
    if block_k is None:
        block_k = 64 if d > 64 or jnp.dtype(k_cache.dtype).itemsize > 2 else 128
    bk = next_pow2(block_k)
    while bk > 16 and s % bk:
        bk //= 2
    if s % bk:  # S not a multiple of 16: pad the cache (copies it; avoid such S in serving)
        s_pad = -(-s // 16) * 16
        padw = ((0, 0), (0, 0), (0, s_pad - s), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, padw), jnp.pad(v_cache, padw)
        bk = 16
    s_eff = k_cache.shape[-2]

    scale_mode, ks, vs = prepare_scales(k_scale, v_scale, b, s, kvh)
    if scale_mode == "per_token" and s_eff != s:
        padw = ((0, 0), (0, 0), (0, s_eff - s))
        ks, vs = jnp.pad(ks, padw), jnp.pad(vs, padw)

    if num_splits is None:
        num_splits = choose_num_splits(b, kvh, n_q, s)
    num_splits = max(1, min(int(num_splits), s_eff // bk))

    qr = heads_to_rows(q, kvh, m_pad)
    pos = row_positions(q_positions, g, m_pad, s)

    kv_dtype = jnp.dtype(k_cache.dtype)
    compute_dtype = jnp.dtype(q.dtype)
    if compute_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        compute_dtype = jnp.dtype(jnp.float32)
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    del kv_dtype

    grid = (b, kvh, n_q, num_splits)
    if stacked:  # every layer of this (sequence, kv head); the kernel indexes one
        kv_spec = pl.BlockSpec((None, num_layers, None, s_eff, d), lambda i, j, qb, sp: (i, 0, j, 0, 0))
    else:
        kv_spec = pl.BlockSpec((None, None, s_eff, d), lambda i, j, qb, sp: (i, j, 0, 0))
    in_specs = [
        pl.BlockSpec((None, None, bm, d), lambda i, j, qb, sp: (i, j, qb, 0)),
        kv_spec,
        kv_spec,
        pl.BlockSpec((None, bm), lambda i, j, qb, sp: (i, qb)),
    ]
    args = [qr, k_cache, v_cache, pos]
    if stacked:
        in_specs.append(pl.BlockSpec((1,), lambda i, j, qb, sp: (0,)))
        args.append(jnp.reshape(layer, (1,)).astype(jnp.int32))
    skip = skip_lo is not None
    if skip != (skip_hi is not None):
        raise ValueError("skip_lo and skip_hi go together: pass both or neither")
    if skip:  # padding rows hide nothing (lo == hi == 0)
        in_specs += [pl.BlockSpec((None, bm), lambda i, j, qb, sp: (i, qb))] * 2
        args += [skip_rows(skip_lo, g, m_pad), skip_rows(skip_hi, g, m_pad)]
    if scale_mode == "per_head":
        spec = pl.BlockSpec((None,), lambda i, j, qb, sp: (j,))
        in_specs += [spec, spec]
        args += [ks, vs]
    elif scale_mode == "per_token":
        spec = pl.BlockSpec((None, None, s_eff), lambda i, j, qb, sp: (i, j, 0))
        in_specs += [spec, spec]
        args += [ks, vs]

    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((b, kvh, m_pad, d), q.dtype)]
        out_specs = [pl.BlockSpec((None, None, bm, d), lambda i, j, qb, sp: (i, j, qb, 0))]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((b, kvh, num_splits, m_pad, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, num_splits, m_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, num_splits, m_pad), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, None, bm, d), lambda i, j, qb, sp: (i, j, sp, qb, 0)),
            pl.BlockSpec((None, None, None, bm), lambda i, j, qb, sp: (i, j, sp, qb)),
            pl.BlockSpec((None, None, None, bm), lambda i, j, qb, sp: (i, j, sp, qb)),
        ]

    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        block_k=bk,
        num_splits=num_splits,
        seq_len=s,
        scale_mode=scale_mode,
        compute_dtype=compute_dtype,
        precision=precision,
        skip=skip,
        stacked=stacked,
    )
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="cache_attention_triton",
    )(*args)
    if num_splits == 1:
        o = outs[0]
    else:
        o = combine_splits(*outs, q.dtype)
    return rows_to_heads(o, t, g)

"""Cache attention as a Mosaic GPU (Hopper, sm_90a) Pallas kernel: TMA + wgmma.

Same contract as `kernels_pallas.cache_attention.cache_attention_reference`.

Structure (``plgpu.kernel``, one warpgroup per CTA, grid ``(B, KVH, query blocks x splits)``):

* The ``T * G`` query rows that share one kv head are one ``[64, D]`` tile in SMEM (wgmma's M is
  64 per warpgroup; rows padded, see `kernels_pallas._common`), loaded once by TMA, so each K/V
  block is read once from HBM for all G heads (GQA reuse).
* K/V blocks ``[BK, D]`` are TMA-copied straight out of the ``[B, KVH, S, D]`` cache (a contiguous
  2-D box, no relayout) into a ring of ``num_slots`` buffers: blocks j+1 .. j+num_slots-1 are
  in flight while block j is computed, and a slot is refilled as soon as block j is done.
* ``S = Q @ K.T`` and ``O += P @ V`` are wgmma with float32 accumulators; online softmax in
  float32 in the log2 domain; each row is masked by its own absolute position (loaded into the
  wgmma row layout), and the loop stops at the query block's max position (computed in XLA), not
  at the cache capacity. A tree mask (``skip_lo`` / ``skip_hi``) also hides each row's window
  [lo, hi), loaded into the same row layout.
* Split-K over the key range when (batch x kv head) programs underfill the GPU, merged in XLA.
* K/V dtypes: bfloat16 / float16 (same as q). float8_e4m3fn K/V: the fp8 block is TMA-copied
  (half the bytes), upcast to q's dtype in registers with the per-token scale applied per key
  row, written to a 16-bit SMEM tile, then the same wgmma (16-bit caches with scales take the
  same path). Per-head scales are scalars per program, folded into the softmax scale / output.
  float32 q/K/V are not handled here (`cache_attention` routes them to Triton).

Head dims 64 and 128. Needs a Hopper GPU to run natively; on CPU it runs in Mosaic GPU's own
interpreter (``interpret=True``, private jax API ``jax._src.pallas.mosaic_gpu.interpret``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas._common import (
    choose_num_splits,
    combine_splits,
    default_sm_scale,
    heads_to_rows,
    prepare_scales,
    row_positions,
    rows_to_heads,
    skip_rows,
)

BLOCK_M = 64  # wgmma M per warpgroup
_NEG_INIT = -1e30
_LOG2E = math.log2(math.e)

SUPPORTED_Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SUPPORTED_KV_DTYPES = SUPPORTED_Q_DTYPES + (jnp.dtype(jnp.float8_e4m3fn),)


def supports(q_dtype, kv_dtype, head_dim: int, seq_len: int | None = None) -> str | None:
    """None if this kernel handles the combination, else the reason it does not."""
    if jnp.dtype(q_dtype) not in SUPPORTED_Q_DTYPES:
        return f"q dtype {jnp.dtype(q_dtype)} (needs bfloat16/float16)"
    kv = jnp.dtype(kv_dtype)
    if kv not in SUPPORTED_KV_DTYPES:
        return f"kv dtype {kv}"
    if kv.itemsize == 2 and kv != jnp.dtype(q_dtype):
        return f"kv dtype {kv} != q dtype {jnp.dtype(q_dtype)}"
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} (needs 64 or 128)"
    if seq_len is not None and seq_len % 64:
        return f"cache length {seq_len} (needs a multiple of 64)"
    return None


def interpreter_available() -> bool:
    """Whether this jax has the (private) Mosaic GPU CPU interpreter."""
    try:
        _interpret_params()
    except Exception:  # noqa: BLE001
        return False
    return True


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _smem_transforms(dtype, minor: int):
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = min(128, minor * bits // 8)
    return (
        plgpu.TilingTransform((8, swizzle * 8 // bits)),
        plgpu.SwizzleTransform(swizzle),
    )


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    pos_ref,
    nblk_ref,
    *refs,
    sm_scale: float,
    block_k: int,
    num_splits: int,
    num_slots: int,
    scale_mode: str | None,
    dequant: bool,
    dtype,
    interpret: bool,
    skip: bool,
):
    # The Mosaic GPU CPU interpreter of jax 0.10 has neither `layout_cast` nor `plgpu.load`;
    # layouts mean nothing there, so they are dropped in interpret mode.
    def layout_cast(x, layout):
        return x if interpret else plgpu.layout_cast(x, layout)

    def load_vec(ref, layout):
        # A small GMEM vector straight into a register layout: Mosaic GPU lowers this only as
        # an unoptimized (per-element) load, which is fine for 64 positions / scales.
        if interpret:
            return ref[...]
        return plgpu.load(ref, layout=layout, optimized=False)

    lo_ref = hi_ref = ks_ref = vs_ref = None
    if skip:
        lo_ref, hi_ref, *refs = refs
    if scale_mode is not None:
        ks_ref, vs_ref, *refs = refs
    if num_splits == 1:
        (o_ref, *scratch) = refs
        m_out = l_out = None
    else:
        (o_ref, m_out, l_out, *scratch) = refs
    (q_smem, k_smem, v_smem, kc_smem, vc_smem, o32_smem, ml_smem, q_bar, k_bar, v_bar) = scratch

    b = lax.axis_index("b")
    h = lax.axis_index("h")
    qs = lax.axis_index("qs")
    qb = lax.div(qs, jnp.int32(num_splits))
    sp = lax.rem(qs, jnp.int32(num_splits))
    rows = pl.ds(qb * BLOCK_M, BLOCK_M)

    n_blocks = nblk_ref[b, qb]
    if num_splits == 1:
        lo, hi = jnp.int32(0), n_blocks
    else:
        per = lax.div(n_blocks + (num_splits - 1), jnp.int32(num_splits))
        lo = jnp.minimum(sp * per, n_blocks)
        hi = jnp.minimum(lo + per, n_blocks)

    plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_bar)

    def issue(j, slot):
        src = (b, h, pl.ds(j * block_k, block_k))
        plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_bar.at[slot])

    for i in range(num_slots):  # prologue: fill the ring

        @pl.when(lo + i < hi)
        def _(i=i):  # traced at once (no late binding); the default makes that explicit
            issue(lo + i, i)

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    pos = load_vec(pos_ref.at[b, rows], row_layout)
    pos2 = lax.broadcast_in_dim(pos, (BLOCK_M, block_k), [0])
    if skip:  # the tree mask: each row's hidden window [lo, hi)
        lo2 = lax.broadcast_in_dim(load_vec(lo_ref.at[b, rows], row_layout), (BLOCK_M, block_k), [0])
        hi2 = lax.broadcast_in_dim(load_vec(hi_ref.at[b, rows], row_layout), (BLOCK_M, block_k), [0])

    qk_scale = sm_scale * _LOG2E
    if scale_mode == "per_head":
        qk_scale = ks_ref[h] * qk_scale
    plgpu.barrier_wait(q_bar)

    def upcast(src_smem, dst_smem, scale_ref, j):
        x = src_smem[...].astype(jnp.float32)  # [BK, D]
        if scale_mode == "per_token":
            # [B, KVH, S] scales, read in place: no relayout pass over them.
            sc = load_vec(scale_ref.at[b, h, pl.ds(j * block_k, block_k)], row_layout)
            x = x * lax.broadcast_in_dim(sc, x.shape, [0])
        dst_smem[...] = x.astype(dtype)
        plgpu.commit_smem()

    head_dim = q_smem.shape[-1]

    def body(j, carry):
        acc, m_i, l_i = carry
        slot = lax.rem(j - lo, jnp.int32(num_slots))

        plgpu.barrier_wait(k_bar.at[slot])
        if dequant:
            upcast(k_smem.at[slot], kc_smem, ks_ref, j)
            k_tile = kc_smem
        else:
            k_tile = k_smem.at[slot]

        def compute_qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
            return acc_ref[...]

        if interpret:
            # jax 0.10's Mosaic GPU interpreter has no `transpose_ref` wgmma operand: the two
            # products run as plain dots there (TMA, barriers, masking, softmax, splits and the
            # fp8 upcast are still interpreted).
            s = lax.dot_general(
                q_smem[...], k_tile[...], (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
        else:
            s = pl.run_scoped(compute_qk, plgpu.ACC((BLOCK_M, block_k), jnp.float32))
        s = s * qk_scale  # log2 domain
        kv_ids = layout_cast(
            lax.broadcasted_iota(jnp.int32, (BLOCK_M, block_k), 1), plgpu.Layout.WGMMA
        ) + j * block_k
        visible = kv_ids <= pos2
        if skip:
            visible = visible & ~((kv_ids >= lo2) & (kv_ids < hi2))
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        plgpu.barrier_wait(v_bar.at[slot])
        if dequant:
            upcast(v_smem.at[slot], vc_smem, vs_ref, j)
            v_tile = vc_smem
        else:
            v_tile = v_smem.at[slot]
        p16 = p.astype(dtype)

        def compute_pv(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_tile)

        if interpret:
            # The 0.10 interpreter's wgmma takes SMEM operands only (p16 lives in registers).
            acc = acc + jnp.dot(p16, v_tile[...], preferred_element_type=jnp.float32)
        else:
            acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))

        # Both products of block j are complete (their results were read): refill its slot.
        @pl.when(j + num_slots < hi)
        def _():
            issue(j + num_slots, slot)

        return acc, m_new, l_i

    acc = layout_cast(jnp.full((BLOCK_M, head_dim), 0, dtype=jnp.float32), plgpu.Layout.WGMMA)
    m_i = layout_cast(jnp.full((BLOCK_M,), _NEG_INIT, dtype=jnp.float32), row_layout)
    l_i = layout_cast(jnp.full((BLOCK_M,), 0, dtype=jnp.float32), row_layout)
    acc, m_i, l_i = lax.fori_loop(lo, hi, body, (acc, m_i, l_i))
    del col_layout

    if scale_mode == "per_head":
        acc = acc * vs_ref[h]
    if num_splits == 1:
        l_safe = jnp.where(l_i > 0, l_i, 1.0)
        out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        q_smem[...] = out.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, h, rows])
    else:
        o32_smem[...] = acc
        ml_smem[0] = m_i * (1.0 / _LOG2E)  # back to natural-log domain for combine_splits
        ml_smem[1] = l_i
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o32_smem, o_ref.at[b, h, sp, rows])
        plgpu.copy_smem_to_gmem(ml_smem.at[0], m_out.at[b, h, sp, rows])
        plgpu.copy_smem_to_gmem(ml_smem.at[1], l_out.at[b, h, sp, rows])
    plgpu.wait_smem_to_gmem(0)


def cache_attention_mosaic(
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
    interpret=False,
    block_k: int = 64,
    num_splits: int | None = None,
    num_slots: int | None = None,
):
    """Mosaic GPU cache attention; see the module docstring.

    ``interpret``: False (compile for the GPU), True (Mosaic GPU's CPU interpreter), or an
    ``InterpretGPUParams`` instance (e.g. with ``detect_races=True``).
    """
    b, t, h, d = q.shape
    _, kvh, s, dk = k_cache.shape
    if dk != d or v_cache.shape != k_cache.shape or k_cache.shape[0] != b:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    if h % kvh:
        raise ValueError(f"num heads {h} not a multiple of kv heads {kvh}")
    if (why := supports(q.dtype, k_cache.dtype, d, s)) is not None:
        raise NotImplementedError(f"cache_attention_mosaic does not support {why}")
    if v_cache.dtype != k_cache.dtype:
        raise NotImplementedError("k and v caches must share a dtype")
    g = h // kvh
    skip = skip_lo is not None
    if skip != (skip_hi is not None):
        raise ValueError("skip_lo and skip_hi go together: pass both or neither")
    sm_scale = default_sm_scale(d, sm_scale)
    dtype = jnp.dtype(q.dtype)
    fp8 = jnp.dtype(k_cache.dtype) == jnp.dtype(jnp.float8_e4m3fn)

    if s % block_k:
        block_k = 64
    n_q = -(-(t * g) // BLOCK_M)
    m_pad = n_q * BLOCK_M

    qr = heads_to_rows(q, kvh, m_pad)
    pos = row_positions(q_positions, g, m_pad, s)
    # Key blocks each query block needs: cdiv(max row position + 1, BK).
    max_pos = jnp.max(pos.reshape(b, n_q, BLOCK_M), axis=-1)
    nblk = ((max_pos + block_k) // block_k).astype(jnp.int32)  # [B, n_q]

    scale_mode, ks, vs = prepare_scales(k_scale, v_scale, b, s, kvh)
    # Scaled or fp8 caches go through the upcast-in-registers path ("dequant").
    dequant = fp8 or scale_mode is not None
    if fp8 and scale_mode is None:
        scale_mode = "per_head"
        ks = vs = jnp.ones((kvh,), jnp.float32)

    if num_splits is None:
        num_splits = choose_num_splits(b, kvh, n_q, s)
    num_splits = max(1, min(int(num_splits), s // block_k))

    kv_dtype = jnp.dtype(k_cache.dtype)
    if num_slots is None:
        # ~112 KB of SMEM for D=128 (two CTAs per SM): 3 x 16-bit or 4 x fp8 K/V blocks in flight.
        num_slots = 4 if kv_dtype.itemsize == 1 else 3
    num_slots = max(1, int(num_slots))
    tr16 = _smem_transforms(dtype, d)
    tr_kv = _smem_transforms(kv_dtype, d)
    scratch = [
        plgpu.SMEM((BLOCK_M, d), dtype, transforms=tr16),  # q (and the 16-bit output)
        plgpu.SMEM((num_slots, block_k, d), kv_dtype, transforms=tr_kv),  # k ring
        plgpu.SMEM((num_slots, block_k, d), kv_dtype, transforms=tr_kv),  # v ring
        plgpu.SMEM((block_k, d), dtype, transforms=tr16) if dequant else None,  # upcast k
        plgpu.SMEM((block_k, d), dtype, transforms=tr16) if dequant else None,  # upcast v
        plgpu.SMEM((BLOCK_M, d), jnp.float32) if num_splits > 1 else None,  # partial o
        plgpu.SMEM((2, BLOCK_M), jnp.float32) if num_splits > 1 else None,  # partial m, l
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=num_slots),
        plgpu.Barrier(num_barriers=num_slots),
    ]
    if num_splits == 1:
        out_type = jax.ShapeDtypeStruct((b, kvh, m_pad, d), dtype)
    else:
        out_type = (
            jax.ShapeDtypeStruct((b, kvh, num_splits, m_pad, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, num_splits, m_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, num_splits, m_pad), jnp.float32),
        )
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        block_k=block_k,
        num_splits=num_splits,
        num_slots=num_slots,
        scale_mode=scale_mode,
        dequant=dequant,
        dtype=dtype,
        interpret=interpret is not False,
        skip=skip,
    )
    args = [qr, k_cache, v_cache, pos, nblk]
    if skip:  # padding rows hide nothing (lo == hi == 0)
        args += [skip_rows(skip_lo, g, m_pad), skip_rows(skip_hi, g, m_pad)]
    if scale_mode is not None:
        args += [ks, vs]
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(b, kvh, n_q * num_splits),
        grid_names=("b", "h", "qs"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=(
            None if interpret is False else _interpret_params() if interpret is True else interpret
        ),
    )
    outs = call(*args)
    if num_splits == 1:
        o = outs
    else:
        o = combine_splits(*outs, dtype)
    return rows_to_heads(o, t, g)

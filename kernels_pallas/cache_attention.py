"""Multi-query cache attention: T query rows per sequence against its KV cache.

Layout (shared with `peagle_jax.cache`):
  q            [B, T, H, D]     query rows of this step (already rotary-embedded)
  k, v cache   [B, KVH, S, D]   row s of head h holds the key/value of absolute position s
  q_positions  [B, T]           absolute position of each query row

Query row (b, t) attends to cache rows s <= q_positions[b, t]. Rows above a sequence's
committed length are never read by a query below them, so stale rows (rejected drafts,
placeholder slots, prompt padding) need no clearing: causality by absolute position is the
whole mask.

A tree verify (two draft chains from one root in one forward, `generate.steps`) adds one
hidden window per query row: with `skip_lo` / `skip_hi` [B, T], row (b, t) also does not see
rows skip_lo[b, t] <= s < skip_hi[b, t]. A second chain written after the first sees the
committed rows and the root, skips the first chain's rows, and sees its own rows, causally.
Any set of side chains that fork from one main chain fits this mask: each side chain lies in
its own contiguous rows after the main chain, and skips everything between its fork point
and its own first row. Rows with skip_lo == skip_hi hide nothing.

The cache is heads-major (each kv head's rows contiguous) so that a step's attention is a
batched matmul over (sequence, kv head) that reads the cache where it lies: with the rows
first ([B, S, KVH, D]) XLA:CPU transposed and upcast the whole cache in every layer of every
step, which cost more than the layer's projections (measured on 2 cores: 0.34 -> 0.12 ms per
layer at one row and 448 cached positions, 9.1 -> 1.7 ms at 32 sequences x 4 rows).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_pallas.fp8 import dequantize

#: Query blocks up to this many rows are attended row by row by default (0: never). The
#: batched form is already row-invariant on XLA:CPU (tests/generate/test_row_invariance.py), so this
#: stays off; `benchmarks.forward_rows` sets it to compare both.
ROWWISE_MAX_ROWS = 0


#: Key positions per block of the reference. A step reads only the blocks that hold a position
#: some query row can see, so its cost follows the live length, not the cache capacity: a
#: server sized for 8k tokens read all 8k rows per layer and step before (1.9 ms per layer at
#: 4 query rows on 2 CPU cores, against 0.2 ms for a one-block read). A cache of at most one
#: block is read whole, with no loop. 128 rather than 512: a block is read whole however few of
#: its keys are live, so larger blocks spend more on masked keys. On the server (1024-row
#: cache, HumanEval prompts, batch 4, AVX-512 host) a 1-row prefill of ~150 tokens took 196 ms
#: against 258 ms at 512, and engine throughput rose 10% (`benchmarks.engine_load`).
KEY_BLOCK = 128


def cache_attention_reference(
    q: Float[Array, "B T H D"],
    k_cache: Float[Array, "B KVH S D"],
    v_cache: Float[Array, "B KVH S D"],
    q_positions: Int[Array, "B T"],
    *,
    k_scale: Float[Array, "..."] | None = None,
    v_scale: Float[Array, "..."] | None = None,
    sm_scale: float | None = None,
    skip_lo: Int[Array, "B T"] | None = None,
    skip_hi: Int[Array, "B T"] | None = None,
    sinks: Float[Array, " H"] | None = None,
    window: int | Int[Array, ""] | None = None,
    rowwise: bool | None = None,
    key_block: int = KEY_BLOCK,
) -> Float[Array, "B T H D"]:
    """XLA reference: fp32 online softmax over the live key blocks, GQA by reshaping.

    Keys are read in blocks of ``key_block`` positions, only as many blocks as the furthest
    query row of the batch can see (a dynamic trip count), with a running max and sum as in
    flash attention. A block a row cannot see leaves its max, sum and output bitwise unchanged
    (its weights are exactly 0 and the rescale factor exactly 1), so a row's result does not
    depend on how far other rows reach.

    Both products take the cache in its own dtype and accumulate in float32 (bf16 x bf16 ->
    f32 is the fast XNNPACK path on CPU; an fp32 upcast of the cache would copy it). The
    weights are cast to the cache dtype for the second product, as flash attention does. An
    FP8 or scaled cache is dequantized to float32 block by block; mixed dtypes promote.

    Every query row of a (sequence, kv head) is one row of the same [T*G, D] x [D, block]
    product, whose per-row result does not depend on T on XLA:CPU, so a 1-row decode step
    and a K+1-row verify give a row the same values and greedy speculative decoding stays
    token-identical to plain decoding (tests/generate/test_row_invariance.py fails if that changes).
    ``rowwise`` (default: T <= ROWWISE_MAX_ROWS) attends one query row at a time instead.

    ``skip_lo`` / ``skip_hi`` hide rows [lo, hi) from each query row (the tree mask, see the
    module docstring); hidden keys get weight exactly 0, as future ones do.

    ``sinks`` (GPT-OSS): one logit per query head that joins every row's softmax with a zero
    value, so a row can give little weight to all its keys; it starts the running max and sum.
    ``window``: a row at position p sees only positions > p - window (sliding-window layers).
    """
    if rowwise is None:
        rowwise = q.shape[1] <= ROWWISE_MAX_ROWS
    if sm_scale is None:
        sm_scale = 1.0 / float(q.shape[-1]) ** 0.5
    skip = _skip_window(skip_lo, skip_hi)
    cache = _BlockedCache(k_cache, v_cache, k_scale, v_scale, q.dtype, min(key_block, k_cache.shape[2]))
    if not rowwise:
        return _attend(q, cache, q_positions, sm_scale, skip, sinks, window)
    # Unrolled (T is small): measured faster on XLA:CPU than a lax.map over the rows.
    rows = [_attend(q[:, t:t + 1], cache, q_positions[:, t:t + 1], sm_scale,
                    None if skip is None else (skip[0][:, t:t + 1], skip[1][:, t:t + 1]), sinks, window)
            for t in range(q.shape[1])]
    return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1)


class _BlockedCache:
    """A K/V cache read one block of positions at a time, dequantized and promoted per block."""

    def __init__(self, k, v, k_scale, v_scale, q_dtype, block: int):
        self.k, self.v, self.k_scale, self.v_scale, self.block = k, v, k_scale, v_scale, block
        self.capacity = k.shape[2]
        k_dtype = jnp.float32 if _needs_dequant(k, k_scale) else k.dtype
        v_dtype = jnp.float32 if _needs_dequant(v, v_scale) else v.dtype
        self.dtype = jnp.promote_types(jnp.promote_types(q_dtype, k_dtype), v_dtype)  # one dtype: no-op

    def start(self, i: int | Int[Array, ""]) -> Int[Array, ""]:
        """First position of block i; the last block is shifted back to end at the capacity
        (its positions below i * block, already seen, are masked by the caller)."""
        return jnp.minimum(i * self.block, self.capacity - self.block)

    def read(self, start) -> tuple[Float[Array, "B KVH C D"], Float[Array, "B KVH C D"]]:
        return (_read_block(self.k, self.k_scale, start, self.block, self.dtype),
                _read_block(self.v, self.v_scale, start, self.block, self.dtype))


def _skip_window(skip_lo, skip_hi):
    """(lo, hi) int32 [B, T], or None when no row hides anything."""
    if (skip_lo is None) != (skip_hi is None):
        raise ValueError("skip_lo and skip_hi go together: pass both or neither")
    if skip_lo is None:
        return None
    return skip_lo.astype(jnp.int32), skip_hi.astype(jnp.int32)


def _needs_dequant(x, scale) -> bool:
    return scale is not None or jnp.dtype(x.dtype).itemsize == 1


def _read_block(x, scale, start, block: int, dtype) -> Float[Array, "B KVH C D"]:
    """Positions start .. start + block of a cache, dequantized in fp32 if FP8 / scaled."""
    xb = jax.lax.dynamic_slice_in_dim(x, start, block, axis=2)
    if scale is not None:
        if scale.ndim == 4 and scale.shape[2] == x.shape[2]:  # per position: its block
            scale = jax.lax.dynamic_slice_in_dim(scale, start, block, axis=2)
        xb = dequantize(xb, scale)
    elif _needs_dequant(x, scale):  # FP8 without a scale: its values as they are, in fp32
        xb = xb.astype(jnp.float32)
    return xb.astype(dtype)


def _attend(
    q: Float[Array, "B T H D"], cache: _BlockedCache, q_positions: Int[Array, "B T"], sm_scale: float,
    skip: tuple[Int[Array, "B T"], Int[Array, "B T"]] | None = None,
    sinks: Float[Array, " H"] | None = None, window: int | Int[Array, ""] | None = None,
) -> Float[Array, "B T H D"]:
    """Causal-by-position attention of T rows; the G query heads of a kv head and the T rows
    form one [T*G, D] block per (sequence, kv head).

    The softmax denominator is P @ ones, a product like P @ V, rather than a sum over the
    block: XLA:CPU's vectorized reduction groups keys by their row index, so the same keys at
    other rows (a tree verify's second chain, `generate.tree`) summed differently in the last
    bit (1 row in 300-1000), while the product's sum does not depend on where the keys lie
    (0 of 2300 in the same test). It costs no measurable time (a 1-row SmolLM2 step: 29.4 ms
    against 30.4 with the reduction; 4 rows 35.2 against 36.4)."""
    b, t, h, d = q.shape
    kvh = cache.k.shape[1]
    g = h // kvh
    qg = q.astype(cache.dtype).reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * g, d)
    per_row = lambda x: jnp.repeat(x, g, axis=1)[:, None, :, None]  # [B, 1, T*G, 1], row t*G + g
    row_pos = per_row(q_positions)
    row_lo, row_hi = (None, None) if skip is None else (per_row(skip[0]), per_row(skip[1]))
    num_blocks = jnp.minimum(jnp.max(q_positions) // cache.block + 1, -(-cache.capacity // cache.block))

    def block_step(i, carry):
        m, total, acc = carry
        start = cache.start(i)
        k, v = cache.read(start)
        scores = jnp.einsum("bkqd,bksd->bkqs", qg, k, preferred_element_type=jnp.float32) * sm_scale
        pos = start + jnp.arange(cache.block)
        visible = (pos <= row_pos) & (pos >= i * cache.block)  # [B, 1, T*G, C]
        if row_lo is not None:
            visible = visible & ~((pos >= row_lo) & (pos < row_hi))
        if window is not None:
            visible = visible & (pos > row_pos - window)
        scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))
        # A window or a skip can hide a whole block from a row that has seen nothing yet (max still
        # -inf): a document packed after others skips every row before its start.
        hides_blocks = window is not None or row_lo is not None
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new) if hides_blocks else m_new
        weights = jnp.exp(scores - m_ref)
        rescale = jnp.exp(m - m_ref)
        # The weights' sum as a product with a ones matrix, not a reduction (see the docstring).
        # The barrier keeps XLA from rewriting the product back into a reduce.
        p = weights.astype(v.dtype)
        ones = jax.lax.optimization_barrier(jnp.ones((cache.block, 16), v.dtype))
        block_sum = jnp.einsum("bkqs,sn->bkqn", p, ones, preferred_element_type=jnp.float32)[..., :1]
        pv = jnp.einsum("bkqs,bksd->bkqd", p, v, preferred_element_type=jnp.float32)
        return m_new, total * rescale + block_sum, acc * rescale + pv

    init = (jnp.full((b, kvh, t * g, 1), -jnp.inf, jnp.float32), jnp.zeros((b, kvh, t * g, 1), jnp.float32),
            jnp.zeros((b, kvh, t * g, d), jnp.float32))
    if sinks is not None:  # the sink is a key seen first: weight exp(0) = 1 at max = its logit, value 0
        sink = jnp.tile(sinks.astype(jnp.float32).reshape(kvh, 1, g), (1, t, 1)).reshape(1, kvh, t * g, 1)
        init = (jnp.broadcast_to(sink, init[0].shape), jnp.ones_like(init[1]), init[2])
    # Block 0 is visible to every row: it runs unconditionally, and a loop over the others runs
    # as many times as the furthest row needs (none for a context within one block).
    carry = block_step(0, init)
    if cache.capacity > cache.block:
        carry = jax.lax.fori_loop(1, num_blocks, block_step, carry)
    _, total, acc = carry
    out = acc / total
    return out.reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d).astype(q.dtype)


#: The row-invariant C++ kernel ("cpu") is added beside these by `peagle_jax.kernels.attention`.
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
    k_cache: Float[Array, "B KVH S D"],
    v_cache: Float[Array, "B KVH S D"],
    q_positions: Int[Array, "B T"],
    *,
    k_scale: Float[Array, "..."] | None = None,
    v_scale: Float[Array, "..."] | None = None,
    sm_scale: float | None = None,
    skip_lo: Int[Array, "B T"] | None = None,
    skip_hi: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
    interpret: bool = False,
) -> Float[Array, "B T H D"]:
    """Dispatch to an implementation; ``None`` or ``"xla"`` is the reference.

    ``skip_lo`` / ``skip_hi`` (both or neither): the tree mask's hidden window per query row.

    ``implementation``: "xla" | "triton" | "mosaic" | "auto" (see `resolve_implementation`);
    ``interpret=True`` runs a requested Pallas kernel in interpret mode (CPU tests).
    The choice is made at trace time from the default backend and the input dtypes.
    """
    impl = resolve_implementation(
        implementation,
        q_dtype=q.dtype,
        kv_dtype=k_cache.dtype,
        head_dim=q.shape[-1],
        seq_len=k_cache.shape[2],
        interpret=interpret,
    )
    if impl == "xla":
        return cache_attention_reference(
            q, k_cache, v_cache, q_positions, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale,
            skip_lo=skip_lo, skip_hi=skip_hi,
        )
    if impl == "triton":
        from kernels_pallas.cache_attention_triton import cache_attention_triton

        return cache_attention_triton(
            q, k_cache, v_cache, q_positions, k_scale=k_scale, v_scale=v_scale,
            sm_scale=sm_scale, skip_lo=skip_lo, skip_hi=skip_hi, interpret=interpret,
        )
    from kernels_pallas.cache_attention_mosaic import cache_attention_mosaic

    return cache_attention_mosaic(
        q, k_cache, v_cache, q_positions, k_scale=k_scale, v_scale=v_scale,
        sm_scale=sm_scale, skip_lo=skip_lo, skip_hi=skip_hi, interpret=interpret,
    )

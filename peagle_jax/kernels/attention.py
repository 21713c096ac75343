"""Cache attention: T query rows per sequence against its KV cache, on the best backend here.

The layout and mask are `kernels_pallas.cache_attention`'s (q [B, T, H, D], cache [B, KVH, S, D],
causal by absolute position, an optional hidden window per row for a tree verify). Backends, in
the order `implementation` can pick them:

  * "triton" / "mosaic" (and "auto"): the Pallas kernels on a CUDA GPU (`kernels_pallas`);
  * "cpu": the row-invariant C++ kernel (`kernels_cpu.cache_attention`): bf16 queries and cache
    on the CPU backend, each row summed over its own keys, so a tree verify's second chain gets
    the bits of its natural rows (`generate.tree`);
  * "xla" (None): the XLA reference, on any backend, and where the others cannot run.

Every fallback is logged once: the Pallas ones under logger "kernels_pallas", the CPU kernel's
under "peagle_jax.kernels". The choice is made at trace time from the backend and the dtypes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

import kernels_cpu
from kernels_pallas.cache_attention import KEY_BLOCK, cache_attention_reference
from kernels_pallas.cache_attention import _gpu_compute_capability as gpu_compute_capability
from kernels_pallas.cache_attention import cache_attention as pallas_cache_attention
from kernels_pallas.cache_attention import resolve_implementation as pallas_resolve_implementation
from peagle_jax.kernels import cpu

__all__ = ["IMPLEMENTATIONS", "KEY_BLOCK", "backend", "cache_attention", "cache_attention_reference",
           "gpu_compute_capability", "resolve_implementation", "rowwise_rows"]

IMPLEMENTATIONS = ("xla", "cpu", "triton", "mosaic", "auto")

logger = logging.getLogger("peagle_jax.kernels")


@functools.cache
def _log_once(why: str) -> None:
    logger.warning("cache_attention(implementation='cpu'): %s; falling back to 'xla'", why)


@functools.cache
def _log_sinks_once(implementation: str) -> None:
    logger.info("cache_attention(implementation=%r): no kernel takes attention sinks or a sliding window yet; "
                "using 'xla'", implementation)


def _check(implementation: str | None) -> None:
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown cache_attention implementation {implementation!r}; "
            f"known: {', '.join(repr(i) for i in IMPLEMENTATIONS)}"
        )


def _cpu_kernel_blocker(q_dtype, kv_dtype) -> str | None:
    """Why the C++ attention cannot serve these inputs here (None: it can)."""
    if jax.default_backend() != "cpu":
        return f"the backend is {jax.default_backend()}, not cpu"
    if jnp.dtype(q_dtype) != jnp.bfloat16 or jnp.dtype(kv_dtype) != jnp.bfloat16:
        return f"it takes bf16 queries and caches, not {jnp.dtype(q_dtype)} / {jnp.dtype(kv_dtype)}"
    return cpu.unavailable_reason()


def resolve_implementation(
    implementation: str | None,
    *,
    q_dtype=jnp.bfloat16,
    kv_dtype=jnp.bfloat16,
    head_dim: int = 128,
    seq_len: int | None = None,
    interpret: bool = False,
) -> str:
    """The implementation `cache_attention` will run: "xla", "cpu", "triton" or "mosaic".

    "cpu" runs the C++ kernel for bf16 queries and caches on the CPU backend and falls back to
    "xla" anywhere else; every other name is `kernels_pallas.resolve_implementation`'s ("auto"
    picks a GPU kernel on a CUDA GPU and "xla" elsewhere, never "cpu")."""
    _check(implementation)
    if implementation != "cpu":
        return pallas_resolve_implementation(implementation, q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim,
                                             seq_len=seq_len, interpret=interpret)
    why = _cpu_kernel_blocker(q_dtype, kv_dtype)
    if why is None:
        return "cpu"
    _log_once(why)
    return "xla"


def cache_attention(
    q: Float[Array, "B T H D"],
    k_cache: Float[Array, "B *L KVH S D"],
    v_cache: Float[Array, "B *L KVH S D"],
    q_positions: Int[Array, "B T"],
    *,
    k_scale: Float[Array, "..."] | None = None,
    v_scale: Float[Array, "..."] | None = None,
    sm_scale: float | None = None,
    skip_lo: Int[Array, "B T"] | None = None,
    skip_hi: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
    interpret: bool = False,
    layer: Int[Array, ""] | None = None,
    sinks: Float[Array, " H"] | None = None,
    window: int | Int[Array, ""] | None = None,
) -> Float[Array, "B T H D"]:
    """Query row (b, t) attends to cache rows s <= q_positions[b, t], outside [skip_lo, skip_hi)
    when given (both or neither), with the implementation `resolve_implementation` picks.

    ``implementation``: "xla" | "cpu" | "triton" | "mosaic" | "auto" (None: "xla");
    ``interpret=True`` runs a requested Pallas kernel in interpret mode (CPU tests). A scaled
    (FP8) cache keeps the reference under "cpu". ``layer``: the caches are a scanned target's
    stacks [B, L, KVH, S, D]; the CPU kernel and the Triton kernel (also where "mosaic" was
    resolved) read that layer in place, the reference gets it sliced out (unscaled caches only).
    ``sinks`` and ``window`` (GPT-OSS's attention sinks and sliding window,
    `cache_attention_reference`) run on the XLA reference: no kernel takes them yet."""
    _check(implementation)
    if sinks is not None or window is not None:
        if implementation not in (None, "xla"):
            _log_sinks_once(implementation)
        if layer is not None:
            k_cache, v_cache = _layer_of(k_cache, v_cache, layer)
        return cache_attention_reference(q, k_cache, v_cache, q_positions, k_scale=k_scale, v_scale=v_scale,
                                         sm_scale=sm_scale, skip_lo=skip_lo, skip_hi=skip_hi, sinks=sinks,
                                         window=window)
    scaled = k_scale is not None or v_scale is not None
    if layer is not None and scaled:
        raise ValueError("cache_attention: a layer of stacked caches is read without scales (FP8 slices its layer)")
    if implementation == "cpu":
        if not scaled and resolve_implementation("cpu", q_dtype=q.dtype, kv_dtype=k_cache.dtype) == "cpu":
            return kernels_cpu.cache_attention(q, k_cache, v_cache, q_positions, sm_scale=sm_scale, skip_lo=skip_lo,
                                               skip_hi=skip_hi, layer=layer)
        implementation = "xla"
    if layer is not None:
        if _triton_reads_layer(implementation, q, k_cache, interpret):
            from kernels_pallas.cache_attention_triton import cache_attention_triton

            return cache_attention_triton(q, k_cache, v_cache, q_positions, sm_scale=sm_scale, skip_lo=skip_lo,
                                          skip_hi=skip_hi, interpret=interpret, layer=layer)
        k_cache, v_cache = _layer_of(k_cache, v_cache, layer)
    return pallas_cache_attention(q, k_cache, v_cache, q_positions, k_scale=k_scale, v_scale=v_scale,
                                  sm_scale=sm_scale, skip_lo=skip_lo, skip_hi=skip_hi,
                                  implementation=implementation, interpret=interpret)


def _layer_of(k_stack, v_stack, layer):
    """Layer `layer` of stacked caches [B, L, KVH, S, D], sliced out (a copy where a custom call reads it)."""
    return tuple(jax.lax.dynamic_index_in_dim(c, layer, axis=1, keepdims=False) for c in (k_stack, v_stack))


def _triton_reads_layer(implementation: str | None, q, k_stack, interpret: bool) -> bool:
    """Whether a Pallas kernel serves this call on a stacked cache, so the Triton kernel reads the
    layer in place: slicing it out would copy the layer's whole cache before every call. A
    resolved "mosaic" (sm_90+) is served by Triton here too; Mosaic reads only a plain cache."""
    impl = resolve_implementation(implementation, q_dtype=q.dtype, kv_dtype=k_stack.dtype, head_dim=q.shape[-1],
                                  seq_len=k_stack.shape[3], interpret=interpret)
    from kernels_pallas import cache_attention_triton as triton

    return (impl in ("triton", "mosaic") and k_stack.shape[3] % 16 == 0
            and triton.supports(q.dtype, k_stack.dtype, q.shape[-1]) is None)


def backend(name: str, *, interpret: bool = False) -> Callable[..., Float[Array, "B T H D"]]:
    """One backend's own function, with no fallback (benchmarks time each as it is): "xla" (the
    reference), "cpu" (the C++ kernel), "triton" or "mosaic" (``interpret``: Pallas interpret mode)."""
    if name == "xla":
        return cache_attention_reference
    if name == "cpu":
        return kernels_cpu.cache_attention
    if name == "triton":
        from kernels_pallas.cache_attention_triton import cache_attention_triton

        return functools.partial(cache_attention_triton, interpret=interpret)
    if name == "mosaic":
        from kernels_pallas.cache_attention_mosaic import cache_attention_mosaic

        return functools.partial(cache_attention_mosaic, interpret=interpret)
    raise ValueError(f"unknown cache_attention backend {name!r}; known: 'xla', 'cpu', 'triton', 'mosaic'")


@contextlib.contextmanager
def rowwise_rows(max_rows: int) -> Iterator[None]:
    """Within the block, the XLA reference attends query blocks of up to `max_rows` rows one row
    at a time (`kernels_pallas.cache_attention.ROWWISE_MAX_ROWS`, read at trace time; 0, the
    default, never): `benchmarks.forward_rows` times both forms."""
    module = importlib.import_module("kernels_pallas.cache_attention")  # not the function of that name
    saved = module.ROWWISE_MAX_ROWS
    module.ROWWISE_MAX_ROWS = max_rows
    try:
        yield
    finally:
        module.ROWWISE_MAX_ROWS = saved

"""Attention kernels for speculative decoding: one op API, several implementations.

`cache_attention` attends a block of T query rows per sequence, at known absolute positions,
to that sequence's KV cache (GQA, causal by absolute position). Every op has an XLA
reference that runs on any backend; Pallas GPU implementations are chosen with
``implementation=`` ("xla" | "triton" | "mosaic" | "auto") and fall back, with a logged
message, to the reference where they cannot run (``interpret=True`` runs them on CPU).
FP8 (float8_e4m3fn) KV caches: `quantize_kv` / `dequantize`, scales passed as
``k_scale`` / ``v_scale``.
"""

from kernels_pallas.cache_attention import (
    IMPLEMENTATIONS,
    cache_attention,
    cache_attention_reference,
    resolve_implementation,
)
from kernels_pallas.fp8 import dequantize, quantize_kv

__all__ = [
    "IMPLEMENTATIONS",
    "cache_attention",
    "cache_attention_reference",
    "dequantize",
    "quantize_kv",
    "resolve_implementation",
]

"""Attention kernels for speculative decoding: one op API, several implementations.

`cache_attention` attends a block of T query rows per sequence, at known absolute positions,
to that sequence's KV cache (GQA, causal by absolute position). Every op has an XLA
reference that runs on any backend; Pallas GPU implementations are chosen with
``implementation=`` and fall back to the reference where they cannot run.
"""

from kernels_pallas.cache_attention import cache_attention, cache_attention_reference

__all__ = ["cache_attention", "cache_attention_reference"]

"""The one seam between the models and the kernels: nothing else under peagle_jax/ (or benchmarks/)
imports `kernels_cpu` or `kernels_pallas` (tests/kernels/test_kernel_seam.py checks it).

Each module holds one concept and decides where its kernel runs, so a caller asks for an
operation, never for a backend:

  cpu        whether and which CPU kernels run here (the one place that asks `kernels_cpu`)
  matmul     the row-invariant CPU matmul and its weight packing; its differentiable form
             for training on a CPU
  attention  cache attention: Pallas on a GPU, the C++ kernel on CPU, the XLA reference elsewhere
  argmax     the greedy token: the C++ argmax on one CPU device, else XLA
  fp8        float8_e4m3fn KV-cache quantization

`kernels_cpu` compiles its library on first use (`cpu.available()`), not on import.
"""

from peagle_jax.kernels import cpu
from peagle_jax.kernels.argmax import argmax
from peagle_jax.kernels.attention import (
    IMPLEMENTATIONS,
    KEY_BLOCK,
    cache_attention,
    cache_attention_reference,
    resolve_implementation,
)
from peagle_jax.kernels.fp8 import compute_scale, dequantize, quantize_kv, quantize_with_scale
from peagle_jax.kernels.matmul import (
    TILE,
    is_group_packed,
    matmul,
    pack,
    pack_g4,
    pack_g8,
    pack_q4,
    pack_q7,
    quantize_group,
    trainable_fits,
    trainable_matmul,
    unpack_group,
)

__all__ = [
    "IMPLEMENTATIONS",
    "KEY_BLOCK",
    "TILE",
    "argmax",
    "cache_attention",
    "cache_attention_reference",
    "compute_scale",
    "cpu",
    "dequantize",
    "is_group_packed",
    "matmul",
    "pack",
    "pack_g4",
    "pack_g8",
    "pack_q4",
    "pack_q7",
    "quantize_group",
    "quantize_kv",
    "quantize_with_scale",
    "resolve_implementation",
    "trainable_fits",
    "trainable_matmul",
    "unpack_group",
]

"""FP8 (float8_e4m3fn) storage of the KV cache: amax scales per token (or per head), quantize on
write and dequantize on read (`kernels_pallas.fp8`, which the attention kernels read too)."""

from kernels_pallas.fp8 import compute_scale, dequantize, quantize_kv, quantize_with_scale

__all__ = ["compute_scale", "dequantize", "quantize_kv", "quantize_with_scale"]

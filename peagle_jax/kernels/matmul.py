"""The row-invariant CPU matmul (`kernels_cpu.matmul`) and the weight packings it reads.

A row's result has the same bits whatever the number of rows in the call, which is what keeps
speculative decoding token-identical to plain decoding on CPU (docs/cpu-kernels.md). Weights are
packed once at load (`pack`: bf16, `pack_q7` / `pack_q4`: 7- or 4-bit per-column weights for a
draft head; `pack_g4` / `pack_g8`: a quantized GGUF target's own blocks), each output tile of
`TILE` columns contiguous.

`trainable_matmul` is the same kernel with gradients, for training a draft head on a CPU: its
AMX tiles run 2.4x XLA:CPU's float32 dot on a head's shapes (docs/training.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, BFloat16, Float, Int, UInt8

import kernels_cpu
from kernels_cpu import (
    G4_RECORD,
    G8_RECORD,
    TILE,
    pack,
    pack_g4,
    pack_g8,
    pack_q4,
    pack_q7,
    quantize_group,
    unpack_group,
    unpack_q4,
    unpack_q7,
)

__all__ = ["TILE", "is_group_packed", "matmul", "pack", "pack_g4", "pack_g8", "pack_q4", "pack_q7", "quantize_group",
           "trainable_fits", "trainable_matmul", "unpack_group", "unpack_q4", "unpack_q7"]


def is_group_packed(packed: jax.Array) -> bool:
    """Whether `packed` is `pack_g4` / `pack_g8` output: a GGUF file's blocks, which the kernel
    serves at every row count (a prompt's prefill too: gemv_group.cc)."""
    return packed.dtype == jnp.uint8 and packed.ndim in (3, 4) and packed.shape[-1] in (G4_RECORD, G8_RECORD)


def matmul(x: Float[Array, "*lead I"], packed: BFloat16[Array, "*L T J 64"] | UInt8[Array, "*L T S _"],
           out_dtype=None, glu: bool = False, layer: Int[Array, ""] | None = None) -> Float[Array, "*lead O"]:
    """x @ w for `packed` = `pack(w)`, `pack_q7(w)`, `pack_q4(w)`, `pack_g4` or `pack_g8`, summed
    in float32.

    `out_dtype`: None keeps the float32 sums; bfloat16 has the kernel round them (the bits of
    converting the float32 sums, without a convert in the graph); any other dtype is converted
    from float32. `glu=True` (bf16 weights and result): x holds a SwiGLU MLP's gate and up
    outputs side by side and the product is taken of bf16(SiLU(gate) * up). `layer`: `packed` is a
    scanned target's stack of packings [L, ...], read at that layer in place."""
    if out_dtype is not None and jnp.dtype(out_dtype) == jnp.bfloat16:
        return kernels_cpu.matmul(x, packed, jnp.bfloat16, glu=glu, layer=layer)
    y = kernels_cpu.matmul(x, packed, glu=glu, layer=layer)
    return y if out_dtype is None else y.astype(out_dtype)


def trainable_fits(x: jax.Array, w: jax.Array) -> bool:
    """Whether `trainable_matmul` takes these shapes: a 2-D weight whose both widths are whole
    tiles (the backward pass multiplies by its transpose) and at least one row."""
    return w.ndim == 2 and x.shape[-1] == w.shape[0] and not w.shape[0] % TILE and not w.shape[1] % TILE \
        and x.size > 0


@jax.custom_vjp
def trainable_matmul(x: Float[Array, "R I"], w: Float[Array, "I O"]) -> Float[Array, "R O"]:
    """x @ w on the CPU kernel, float32 sums of bf16 operands, differentiable: the gradients
    g @ w.T and x.T @ g run on the kernel too, their right-hand sides packed in the step (a
    memory pass, small beside the product). Mixed-precision training's usual rounding: the
    operands' bf16, nothing else. Row invariance is not needed here and not promised."""
    return kernels_cpu.matmul(x.astype(jnp.bfloat16), pack(w.astype(jnp.bfloat16)))


def _trainable_forward(x, w):
    return trainable_matmul(x, w), (x, w)


def _trainable_backward(saved, g):
    x, w = saved
    gb = g.astype(jnp.bfloat16)
    dx = kernels_cpu.matmul(gb, pack(w.astype(jnp.bfloat16).T))
    dw = kernels_cpu.matmul(x.astype(jnp.bfloat16).T, pack(gb))
    return dx.astype(x.dtype), dw.astype(w.dtype)


trainable_matmul.defvjp(_trainable_forward, _trainable_backward)

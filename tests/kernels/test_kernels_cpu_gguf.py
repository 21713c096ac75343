"""A target's weights in their GGUF quantization on the CPU kernel (gemv_group.cc): every block
format parsed exactly as `gguf.quants.dequantize` reads it, the kernel's product against the
dequantized weights, and a row's bits the same whatever the number of rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

import kernels_cpu
from peagle_jax.checkpoints.gguf_blocks import GROUP_TYPES, group_weights

needs_kernel = pytest.mark.skipif(not kernels_cpu.available(),
                                  reason=f"CPU kernel unavailable: {kernels_cpu.unavailable_reason()}")


def random_blocks(qtype: T, rows: int, cols: int, rng) -> np.ndarray:
    """A [rows, cols] tensor of `qtype` as GGUF stores it: random bytes (every pattern is a valid
    block) with each float16 field set to a small finite number."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
    halves = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q8_0: [0], T.Q5_0: [0], T.Q6_K: [208]}[qtype]
    for at in halves:
        b[:, at:at + 2] = (rng.uniform(-0.02, 0.02, len(b)).astype(np.float16)).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("name", GROUP_TYPES)
def test_blocks_parse_to_gguf_dequantize_exactly(name):
    rng = np.random.default_rng(1)
    qtype = T[name]
    data = random_blocks(qtype, 64, 512, rng)
    gw = group_weights(data, qtype, 64, 512)
    reference = dequantize(data, qtype).reshape(64, 512).T  # [in, out]
    np.testing.assert_allclose(gw.dequantize(), reference, rtol=0, atol=2e-7 * np.abs(reference).max())
    order = rng.permutation(64)
    permuted = group_weights(data, qtype, 64, 512, row_order=order)
    np.testing.assert_array_equal(permuted.dequantize(), gw.dequantize()[:, order])


def test_unsupported_types_and_bad_sizes():
    assert group_weights(np.zeros((4, 64), np.float32), T.F32, 4, 64) is None
    assert group_weights(np.zeros((4, 44), np.uint8), T.Q5_1, 4, 64) is None
    with pytest.raises(ValueError, match="does not hold"):
        group_weights(np.zeros((4, 36), np.uint8), T.Q4_0, 4, 96)


@needs_kernel
@pytest.mark.parametrize("name", GROUP_TYPES)
def test_kernel_is_the_dequantized_product_and_row_invariant(name):
    rng = np.random.default_rng(2)
    qtype = T[name]
    out, inp = 96, 512
    gw = group_weights(random_blocks(qtype, out, inp, rng), qtype, out, inp)
    pack = kernels_cpu.pack_g4 if gw.format == "g4" else kernels_cpu.pack_g8
    packed = jnp.asarray(pack(gw.q, gw.scale, gw.min) if gw.format == "g4" else pack(gw.q, gw.scale))
    w = gw.dequantize()
    np.testing.assert_array_equal(np.asarray(kernels_cpu.unpack_group(packed)), w)
    x = rng.standard_normal((7, inp))
    x[0, :64] = 0.0  # an all-zero group
    x[1] *= 1e3  # rows far from 1, and groups spanning many powers of two
    x[2, 32:96] *= np.logspace(-6, 2, 64)
    x = jnp.asarray(x, jnp.bfloat16)
    y = np.asarray(kernels_cpu.matmul(x, packed))
    reference = np.asarray(x, np.float64) @ w.astype(np.float64)
    # the kernel rounds each row's values at 2^-14 of its group's largest (gemv_group.cc): far
    # below the 2^-8 at which the activations are bf16 in the first place
    error = np.abs(y - reference) / np.abs(reference).max(axis=1, keepdims=True)
    assert error.max() < 5e-4, error.max(axis=1)
    for rows in range(1, 7):
        np.testing.assert_array_equal(np.asarray(kernels_cpu.matmul(x[:rows], packed)), y[:rows])
    bf16 = np.asarray(kernels_cpu.matmul(x, packed, jnp.bfloat16))
    np.testing.assert_array_equal(bf16, np.asarray(jnp.asarray(y).astype(jnp.bfloat16)))


def test_packers_reject_shapes_they_cannot_tile():
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels_cpu.pack_g4(np.zeros((64, 40), np.uint8), np.zeros((2, 40), np.float32), np.zeros((2, 40), np.float32))
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels_cpu.pack_g8(np.zeros((24, 32), np.int8), np.zeros((1, 32), np.float32))

"""The CPU kernel's differentiable matmul (training a head on a CPU): its value and both
gradients against XLA's float32 products of the same bf16-rounded operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from peagle_jax import kernels
from peagle_jax.models.layers import matmul, training_matmuls_on_cpu_kernel

needs_kernel = pytest.mark.skipif(not kernels_cpu.available(),
                                  reason=f"kernels_cpu unavailable: {kernels_cpu.unavailable_reason()}")


def _bf16(a):
    return a.astype(jnp.bfloat16).astype(jnp.float32)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_value_and_gradients_match_xla_on_rounded_operands(rows):
    kx, kw, kg = jax.random.split(jax.random.key(rows), 3)
    x = jax.random.normal(kx, (rows, 96))
    w = jax.random.normal(kw, (96, 160)) * 0.1
    probe = jax.random.normal(kg, (rows, 160))

    def loss(dot, x, w):
        return jnp.sum(jnp.tanh(dot(x, w)) * probe)

    ref = jax.value_and_grad(lambda x, w: loss(lambda a, b: _bf16(a) @ _bf16(b), x, w), argnums=(0, 1))
    got = jax.jit(jax.value_and_grad(lambda x, w: loss(kernels.trainable_matmul, x, w), argnums=(0, 1)))
    (v_ref, (dx_ref, dw_ref)), (v, (dx, dw)) = ref(x, w), got(x, w)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    np.testing.assert_allclose(v, v_ref, rtol=1e-4, atol=1e-3)
    # the gradients' own operands (the cotangent) are rounded to bf16 too: ~0.4% per element
    for g, r in ((dx, dx_ref), (dw, dw_ref)):
        assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 1e-2


@needs_kernel
def test_layers_matmul_takes_the_kernel_only_inside_the_block_and_where_it_fits():
    x = jax.random.normal(jax.random.key(0), (2, 5, 64))
    w = jax.random.normal(jax.random.key(1), (64, 96))
    with training_matmuls_on_cpu_kernel():
        inside = jax.make_jaxpr(lambda x, w: matmul(x, w))(x, w)
        odd = jax.make_jaxpr(lambda x, w: matmul(x, w))(x[..., :40], w[:40, :])  # 40 inputs: not whole tiles
    outside = jax.make_jaxpr(lambda x, w: matmul(x, w))(x, w)
    assert "custom_vjp" in str(inside) and "custom_vjp" not in str(outside) and "custom_vjp" not in str(odd)
    assert not kernels.trainable_fits(x, w[:, :40]) and kernels.trainable_fits(x, w)
    with training_matmuls_on_cpu_kernel():
        y = matmul(x, w)
    assert y.shape == (2, 5, 96) and y.dtype == jnp.float32
    np.testing.assert_allclose(y, _bf16(x) @ _bf16(w), rtol=1e-4, atol=1e-4)

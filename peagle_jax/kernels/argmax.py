"""The greedy token: an argmax over the last axis, lowest index on ties (as `jnp.argmax`).

It runs on every row of every round. On one CPU device, float32 rows of a real vocabulary go to
the C++ argmax (`kernels_cpu.argmax`: a few microseconds where XLA:CPU took ~110 us a 49k row,
1-2% of a SmolLM2 decode step), which gives a row holding a NaN its last index. Elsewhere a max
followed by a min over the matching indices: XLA:CPU lowers `argmax` to a variadic (value,
index) reduce that does not vectorise, about 3x slower.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

import kernels_cpu
from peagle_jax.kernels import cpu

KERNEL_MIN_VOCAB = 1024
"""Vocabularies from which `argmax` uses the CPU kernel (smaller rows cost XLA little)."""


@functools.cache
def kernel_available() -> bool:
    """Whether the CPU argmax can serve here: the CPU backend, one device (a custom call does not
    split across a mesh), and the kernel library built and loaded."""
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    return cpu.available()


def argmax(logits: Float[Array, "... V"]) -> Int[Array, "..."]:
    """The lowest index of each row's maximum over the last axis, int32."""
    v = logits.shape[-1]
    if logits.dtype == jnp.float32 and v >= KERNEL_MIN_VOCAB and kernel_available():
        return kernels_cpu.argmax(logits)
    top = jnp.max(logits, axis=-1, keepdims=True)
    idx = jnp.min(jnp.where(logits == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
    return jnp.minimum(idx, v - 1).astype(jnp.int32)

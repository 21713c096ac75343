"""The Triton cache attention reading one layer of a scanned target's stacked caches
[B, L, KVH, S, D] in place (`models.layer_stack`): the same bits as on that layer's cache
alone, in Pallas interpret mode on CPU, through the dispatcher, and lowered for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.cache_attention_triton import cache_attention_triton
from peagle_jax import kernels

B, T, H, KVH, S, D, L = 2, 3, 8, 2, 64, 32, 4


def _inputs(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(B, L, KVH, S, D)), dtype) for _ in range(2))
    pos = jnp.asarray([[10, 11, 12], [40, 41, 63]], jnp.int32)
    return q, k, v, pos


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("tree", [False, True])
def test_layer_in_place_equals_its_own_cache(splits, tree):
    q, k, v, pos = _inputs()
    skip = dict(skip_lo=jnp.asarray([[0, 5, 5], [0, 30, 30]], jnp.int32),
                skip_hi=jnp.asarray([[0, 8, 8], [0, 39, 39]], jnp.int32)) if tree else {}
    for layer in (0, L - 1):
        got = cache_attention_triton(q, k, v, pos, layer=jnp.int32(layer), num_splits=splits, interpret=True, **skip)
        want = cache_attention_triton(q, k[:, layer], v[:, layer], pos, num_splits=splits, interpret=True, **skip)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_dispatcher_reads_the_layer_in_place_under_triton():
    q, k, v, pos = _inputs(jnp.bfloat16)
    for impl in ("triton", "mosaic"):  # a resolved Mosaic reads stacks through the Triton kernel
        got = kernels.cache_attention(q, k, v, pos, implementation=impl, interpret=True, layer=jnp.int32(2))
        want = cache_attention_triton(q, k[:, 2], v[:, 2], pos, interpret=True)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="without scales"):
        cache_attention_triton(q, k, v, pos, layer=jnp.int32(0), k_scale=jnp.ones(()), interpret=True)


def test_layer_in_place_lowers_for_cuda():
    q = jax.ShapeDtypeStruct((1, 8, 64, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 48, 8, 4096, 64), jnp.bfloat16)  # Qwen3-30B-A3B-like stack, 4k context
    pos = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    f = jax.jit(lambda q, k, v, p, i: cache_attention_triton(q, k, v, p, layer=i))
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    try:
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)):
            text = f.trace(q, kv, kv, pos, jax.ShapeDtypeStruct((), jnp.int32)).lower(
                lowering_platforms=("cuda",)).as_text()
    except (ValueError, ImportError) as e:
        if "Cannot lower pallas_call on platform" in str(e) or isinstance(e, ImportError):
            pytest.skip(f"installed jax cannot lower Pallas for cuda: {e}")
        raise
    assert "__gpu$xla.gpu.triton" in text
    assert "dynamic_slice" not in text  # the stack goes to the kernel whole

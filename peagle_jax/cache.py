"""KV cache as a plain pytree: one (k, v) pair per layer, rows indexed by absolute position.

Row s of a sequence's cache holds the key/value of the token at absolute position s; the
layout is heads-major, [B, KVH, S, D], so attention reads each kv head's rows in place (see
peagle_jax.kernels.attention). A step that processes T new rows writes them at their
positions (scatter; rows past the capacity are dropped) and attends causally by position, so
a committed length per sequence is the only bookkeeping: rows above it (rejected drafts,
placeholder slots, prompt padding) are dead and get overwritten by the next step's writes
before any query can read them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from peagle_jax.kernels import compute_scale, quantize_with_scale


class LayerKV(NamedTuple):
    """One layer's K/V. An FP8 (float8_e4m3fn) cache keeps per-token scales beside it."""

    k: Float[Array, "B KVH S D"]
    v: Float[Array, "B KVH S D"]
    k_scale: Float[Array, "B KVH S 1"] | None = None
    v_scale: Float[Array, "B KVH S 1"] | None = None

    @property
    def is_fp8(self) -> bool:
        return self.k_scale is not None

    def write(self, k_rows: Float[Array, "B T KVH D"], v_rows: Float[Array, "B T KVH D"],
              positions: Int[Array, "B T"]) -> LayerKV:
        """Write new rows at their positions, quantizing on write for an FP8 cache."""
        if not self.is_fp8:
            return LayerKV(write_rows(self.k, k_rows, positions), write_rows(self.v, v_rows, positions))
        ks, vs = compute_scale(k_rows), compute_scale(v_rows)  # per token and head: [B, T, KVH, 1]
        return LayerKV(
            write_rows(self.k, quantize_with_scale(k_rows, ks), positions),
            write_rows(self.v, quantize_with_scale(v_rows, vs), positions),
            write_rows(self.k_scale, ks, positions),
            write_rows(self.v_scale, vs, positions),
        )


class KVCache(NamedTuple):
    """Per-layer K/V plus the committed length of each sequence."""

    layers: tuple[LayerKV, ...]
    lengths: Int[Array, " B"]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.layers[0].k.shape[2]

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        batch_size: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=jnp.float32,
    ) -> KVCache:
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        dtype = jnp.dtype(dtype)
        if dtype == jnp.float8_e4m3fn:
            scale_shape = shape[:3] + (1,)  # per (sequence, head, position)
            make = lambda: LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                                   jnp.zeros(scale_shape, jnp.float32), jnp.zeros(scale_shape, jnp.float32))
        elif jnp.issubdtype(dtype, jnp.floating):
            make = lambda: LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        else:
            raise ValueError(f"unsupported KV cache dtype {dtype}; use float32, bfloat16 or float8_e4m3fn")
        layers = tuple(make() for _ in range(num_layers))
        return cls(layers=layers, lengths=jnp.zeros((batch_size,), jnp.int32))

    def with_lengths(self, lengths: Int[Array, " B"]) -> KVCache:
        return self._replace(lengths=lengths.astype(jnp.int32))


def write_rows(
    cache: Float[Array, "B KVH S D"], rows: Float[Array, "B T KVH D"], positions: Int[Array, "B T"]
) -> Float[Array, "B KVH S D"]:
    """Write T rows per sequence at their absolute positions; positions >= S are dropped."""
    b = jnp.arange(cache.shape[0])[:, None]
    # Advanced indices split by a slice: the indexed view is [B, T, KVH, D], the rows' layout.
    return cache.at[b, :, positions].set(rows.astype(cache.dtype), mode="drop")


class TokenHistory(NamedTuple):
    """The tokens of each sequence so far, for drafters that read the context itself (n-gram).

    Row p holds the token at absolute position p + 1, the same row layout as a drafter KV
    cache (drafter row p pairs the feature of position p with token p + 1), so the step API
    writes it exactly where it writes a head's pending rows.
    """

    tokens: Int[Array, "B S"]

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def write(self, rows: Int[Array, "B T"], positions: Int[Array, "B T"]) -> TokenHistory:
        """Write T tokens per sequence at their row positions; positions >= S are dropped."""
        b = jnp.arange(self.tokens.shape[0])[:, None]
        return TokenHistory(self.tokens.at[b, positions].set(rows.astype(jnp.int32), mode="drop"))


def shard_cache(cache: KVCache, mesh) -> KVCache:
    """Constrain K/V to (batch over data, KV heads over model); a no-op without a mesh."""
    if mesh is None:
        return cache
    from peagle_jax.sharding import cache_spec, constrain

    b, kvh, _, _ = cache.layers[0].k.shape
    spec = cache_spec(b, kvh, mesh)
    layers = tuple(LayerKV(*(None if a is None else constrain(a, spec, mesh) for a in layer)) for layer in cache.layers)
    return cache._replace(layers=layers, lengths=constrain(cache.lengths, type(spec)(spec[0]), mesh))

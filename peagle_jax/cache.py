"""KV cache as a plain pytree: one (k, v) pair per layer, rows indexed by absolute position.

Row s of a sequence's cache holds the key/value of the token at absolute position s. A step
that processes T new rows writes them at their positions (scatter; rows past the capacity are
dropped) and attends causally by position, so a committed length per sequence is the only
bookkeeping: rows above it (rejected drafts, placeholder slots, prompt padding) are dead and
get overwritten by the next step's writes before any query can read them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class LayerKV(NamedTuple):
    k: Float[Array, "B S KVH D"]
    v: Float[Array, "B S KVH D"]


class KVCache(NamedTuple):
    """Per-layer K/V plus the committed length of each sequence."""

    layers: tuple[LayerKV, ...]
    lengths: Int[Array, "B"]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.layers[0].k.shape[1]

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        batch_size: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=jnp.float32,
    ) -> "KVCache":
        shape = (batch_size, capacity, num_kv_heads, head_dim)
        layers = tuple(LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers))
        return cls(layers=layers, lengths=jnp.zeros((batch_size,), jnp.int32))

    def with_lengths(self, lengths: Int[Array, "B"]) -> "KVCache":
        return self._replace(lengths=lengths.astype(jnp.int32))


def write_rows(
    cache: Float[Array, "B S KVH D"], rows: Float[Array, "B T KVH D"], positions: Int[Array, "B T"]
) -> Float[Array, "B S KVH D"]:
    """Write T rows per sequence at their absolute positions; positions >= S are dropped."""
    b = jnp.arange(cache.shape[0])[:, None]
    return cache.at[b, positions].set(rows.astype(cache.dtype), mode="drop")


def select_batch(cache: KVCache, mask: jax.Array, new: KVCache) -> KVCache:
    """Per-sequence select between two caches (used to freeze finished sequences)."""
    def pick(a, b):
        m = mask.reshape((-1,) + (1,) * (a.ndim - 1))
        return jnp.where(m, b, a)
    return jax.tree.map(pick, cache, new)


def shard_cache(cache: KVCache, mesh) -> KVCache:
    """Constrain K/V to (batch over data, KV heads over model); a no-op without a mesh."""
    if mesh is None:
        return cache
    from peagle_jax.sharding import cache_spec, constrain

    b, _, kvh, _ = cache.layers[0].k.shape
    spec = cache_spec(b, kvh, mesh)
    layers = tuple(LayerKV(constrain(l.k, spec, mesh), constrain(l.v, spec, mesh)) for l in cache.layers)
    return cache._replace(layers=layers, lengths=constrain(cache.lengths, type(spec)(spec[0]), mesh))

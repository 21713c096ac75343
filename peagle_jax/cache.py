"""KV cache as a plain pytree: one (k, v) pair per layer, rows indexed by absolute position.

Row s of a sequence's cache holds the key/value of the token at absolute position s; the
layout is heads-major, [B, KVH, S, D], so attention reads each kv head's rows in place (see
peagle_jax.kernels.attention). A step that processes T new rows writes them at their
positions (scatter; rows past the capacity are dropped) and attends causally by position, so
a committed length per sequence is the only bookkeeping: rows above it (rejected drafts,
placeholder slots, prompt padding) are dead and get overwritten by the next step's writes
before any query can read them.

A target whose layers run under a scan (`models.layer_stack`) keeps one `StackedKV` instead of
the per-layer tuple, [B, L, KVH, S, D], and each scan step reads and writes its layer through
a `LayerSlot`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
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
        return LayerKV(*_write_layer(self, k_rows, v_rows, lambda a, rows: write_rows(a, rows, positions)))


def _write_layer(kv, k_rows, v_rows, write) -> tuple:
    """(k, v, k_scale, v_scale) of `kv` with `write(array, rows)` applied to each, the rows
    quantized with per-token scales first where the cache is FP8."""
    if not kv.is_fp8:
        return write(kv.k, k_rows), write(kv.v, v_rows)
    ks, vs = compute_scale(k_rows), compute_scale(v_rows)  # per token and head: [B, T, KVH, 1]
    return (write(kv.k, quantize_with_scale(k_rows, ks)), write(kv.v, quantize_with_scale(v_rows, vs)),
            write(kv.k_scale, ks), write(kv.v_scale, vs))


class StackedKV(NamedTuple):
    """Every layer's K/V in one array per field, [B, L, KVH, S, D]: the cache of a target whose
    layers run under a scan (`models.layer_stack`). The batch stays the leading axis, so the
    per-sequence operations (insert, take, finish) treat it as they treat the per-layer tuple."""

    k: Float[Array, "B L KVH S D"]
    v: Float[Array, "B L KVH S D"]
    k_scale: Float[Array, "B L KVH S 1"] | None = None
    v_scale: Float[Array, "B L KVH S 1"] | None = None

    @property
    def is_fp8(self) -> bool:
        return self.k_scale is not None

    def at_layer(self, index: Int[Array, ""]) -> LayerSlot:
        return LayerSlot(self, index)


class LayerSlot(NamedTuple):
    """Layer `index` of a StackedKV as attention sees a LayerKV: a read slices the layer out,
    a write scatters only the new rows into the stack (in place inside the scan's carry)."""

    stack: StackedKV
    index: Int[Array, ""]

    def _layer(self, a):
        return None if a is None else jax.lax.dynamic_index_in_dim(a, self.index, axis=1, keepdims=False)

    @property
    def is_fp8(self) -> bool:
        return self.stack.is_fp8

    @property
    def k(self) -> Float[Array, "B KVH S D"]:
        return self._layer(self.stack.k)

    @property
    def v(self) -> Float[Array, "B KVH S D"]:
        return self._layer(self.stack.v)

    @property
    def k_scale(self) -> Float[Array, "B KVH S 1"] | None:
        return self._layer(self.stack.k_scale)

    @property
    def v_scale(self) -> Float[Array, "B KVH S 1"] | None:
        return self._layer(self.stack.v_scale)

    def write(self, k_rows: Float[Array, "B T KVH D"], v_rows: Float[Array, "B T KVH D"],
              positions: Int[Array, "B T"]) -> LayerSlot:
        """Write new rows at their positions in this layer of the stack."""
        b = jnp.arange(k_rows.shape[0])[:, None]

        def write(stack, rows):  # advanced indices split by a slice: the view is [B, T, KVH, D]
            return stack.at[b, self.index, :, positions].set(rows.astype(stack.dtype), mode="drop")

        return LayerSlot(StackedKV(*_write_layer(self.stack, k_rows, v_rows, write)), self.index)


class KVCache(NamedTuple):
    """Per-layer K/V plus the committed length of each sequence."""

    layers: tuple[LayerKV, ...] | StackedKV
    lengths: Int[Array, " B"]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.layer_arrays()[0].shape[-2]

    @property
    def is_stacked(self) -> bool:
        return isinstance(self.layers, StackedKV)

    def layer_arrays(self) -> list[jax.Array]:
        """Every K/V array (and FP8 scale), per layer or stacked: [B, (L,) KVH, S, D]."""
        groups = [self.layers] if self.is_stacked else self.layers
        return [a for layer in groups for a in layer if a is not None]

    def map_layers(self, fn) -> KVCache:
        """The cache with `fn` applied to every K/V array and scale (axes [B, (L,) KVH, S, D])."""
        apply = lambda group: type(group)(*(None if a is None else fn(a) for a in group))
        return self._replace(layers=apply(self.layers) if self.is_stacked else tuple(map(apply, self.layers)))

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        batch_size: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=jnp.float32,
        *,
        stacked: bool = False,
    ) -> KVCache:
        """An empty cache: a tuple of per-layer LayerKV, or one StackedKV where `stacked` (a
        target whose layers run under a scan)."""
        kind, lead = (StackedKV, (batch_size, num_layers)) if stacked else (LayerKV, (batch_size,))
        shape = lead + (num_kv_heads, capacity, head_dim)
        dtype = jnp.dtype(dtype)
        if dtype == jnp.float8_e4m3fn:
            scale_shape = shape[:-1] + (1,)  # per (sequence, head, position)
            make = lambda: kind(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                                jnp.zeros(scale_shape, jnp.float32), jnp.zeros(scale_shape, jnp.float32))
        elif jnp.issubdtype(dtype, jnp.floating):
            make = lambda: kind(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        else:
            raise ValueError(f"unsupported KV cache dtype {dtype}; use float32, bfloat16 or float8_e4m3fn")
        layers = make() if stacked else tuple(make() for _ in range(num_layers))
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

    first = cache.layer_arrays()[0]
    spec = cache_spec(first.shape[0], first.shape[-3], mesh)
    if cache.is_stacked:  # the layer axis is never split
        spec = type(spec)(spec[0], None, *spec[1:])
    cache = cache.map_layers(lambda a: constrain(a, spec, mesh))
    return cache._replace(lengths=constrain(cache.lengths, type(spec)(spec[0]), mesh))

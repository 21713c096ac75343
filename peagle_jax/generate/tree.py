"""Two draft chains from one root, verified in ONE target forward (a two-branch tree).

A hybrid drafter has two guesses for the same continuation: the head's chain and prompt
lookup's. Verifying both costs one forward over 1 + w_main + w_second rows instead of two
rounds. Per sequence (n = committed length; the root is the last emitted token, position n):

  rows       root | main chain m_1 .. m_wm   | second chain s_1 .. s_ws
  positions  n    | n+1 .. n+wm              | n+1 .. n+ws        (both chains continue the root)
  slots      n    | n+1 .. n+wm              | n+A+1 .. n+A+ws    (the cache rows of their K/V)
  hidden     -    | -                        | rows [n+1, n+A+1): the main chain and the gap

so each chain sees the committed rows, the root and its own rows, causally, and nothing of
the other (`peagle_jax.kernels.cache_attention`'s skip window). Greedy acceptance runs on each
chain; the longer accepted prefix wins. Only the winner is committed: the main chain's K/V
is already where plain decoding puts it, and where the second chain wins its accepted rows'
K/V move down by A (`move_second_chain`, m <= K rows per layer). Rows above the new length
are dead as always.

Exactness: the second chain's rows must get bitwise the logits plain decoding computes for
the same tokens, though their keys lie A rows further on. The attention reference sums each
row's softmax weights by a matrix product (`kernels_pallas.cache_attention._attend`): a
vectorized sum over the key block groups keys by row index and gave the moved rows a
different last bit (1 row in 300-1000); the product did not, at any offset tried. A is
also kept a multiple of 16, so a key keeps its place in any lane grouping up to 16 wide, and
a sequence whose second chain would leave the key block of its natural rows (or the cache)
verifies its main chain alone that round. tests/kernels/test_kernels_cache_attention.py and
tests/generate/test_ngram.py check the rows bitwise; tests/generate/test_row_invariance.py greedy identity
with the shipped head in bf16.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from peagle_jax.cache import KVCache
from peagle_jax.kernels import KEY_BLOCK, cache_attention

#: The second chain's rows start a multiple of this many rows after the root (see above).
CHAIN_ALIGN = 16


def chain_offset(main_width: int, second_width: int) -> int:
    """A: how many rows after the root the second chain's K/V start, minus one.

    At least both widths (the winner's rows then never overlap where they move from)."""
    need = max(main_width, second_width) + 1
    return -(-need // CHAIN_ALIGN) * CHAIN_ALIGN


class TreeLayout(NamedTuple):
    """Where a two-chain verify's rows sit: RoPE positions, cache slots and hidden windows."""

    positions: Int[Array, "B T"]
    slots: Int[Array, "B T"]
    skip_lo: Int[Array, "B T"]
    skip_hi: Int[Array, "B T"]


def two_chain_layout(lengths: Int[Array, " B"], main_width: int, second_width: int) -> TreeLayout:
    """The layout of [root | main chain | second chain] for committed lengths `lengths`."""
    a = chain_offset(main_width, second_width)
    n = lengths[:, None]
    main = jnp.arange(main_width + 1)[None, :]
    second = 1 + jnp.arange(second_width)[None, :]
    positions = jnp.concatenate([n + main, n + second], axis=1)
    slots = jnp.concatenate([n + main, n + a + second], axis=1)
    is_second = jnp.arange(main_width + 1 + second_width)[None, :] > main_width
    lo = jnp.where(is_second, n + 1, 0)
    hi = jnp.where(is_second, n + a + 1, 0)
    return TreeLayout(positions, slots, lo, hi)


def second_chain_rows(main_width: int, second_width: int) -> Int[Array, " R"]:
    """The forward's rows that verify the second chain: the root, then its own rows."""
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), main_width + 1 + jnp.arange(second_width, dtype=jnp.int32)])


def second_chain_fits(lengths: Int[Array, " B"], main_width: int, second_width: int, capacity: int,
                      key_block: int = KEY_BLOCK) -> Bool[Array, " B"]:
    """Where the second chain can be verified exactly: its rows lie inside the cache and, for a
    cache read in several key blocks, in the key block of their natural rows."""
    a = chain_offset(main_width, second_width)
    last = lengths + a + second_width  # the second chain's last slot
    fits = last < capacity
    if capacity > key_block:
        fits = fits & ((lengths + 1) // key_block == last // key_block)
    return fits


def move_second_chain(cache: KVCache, lengths: Int[Array, " B"], main_width: int, second_width: int,
                      count: Int[Array, " B"]) -> KVCache:
    """Every layer's K/V of the second chain's first `count` rows moved to n+1 .. n+count."""
    a = chain_offset(main_width, second_width)
    j = jnp.arange(second_width)[None, :]
    src = lengths[:, None] + a + 1 + j  # [B, W]
    dst = jnp.where(j < count[:, None], lengths[:, None] + 1 + j, cache.capacity)  # past the end: dropped
    b = jnp.arange(lengths.shape[0])[:, None]

    def move(x):  # [B, (L,) KVH, S, D]
        rows = x[b, ..., src, :]  # [B, W, (L,) KVH, D]: advanced indices split by a slice come first
        return x.at[b, ..., dst, :].set(rows, mode="drop")

    return cache.map_layers(move)


def second_chain_mismatches(seed: int = 7, batch: int = 256, width: int = 7, implementation: str = "xla") -> int:
    """Elements of a second chain's attention rows (bf16; `implementation` as in
    `cache_attention`) that differ from the same rows at their natural place: 0 where greedy
    two-chain verify is exact.

    The rows are written CHAIN_ALIGN rows further on with the window between hidden, as
    `two_chain_layout` does. XLA:CPU's dots decide whether a key's place changes the sum's
    rounding: 0 of 1M elements differed on an AVX2 EPYC, 3-8 on a Xeon with AVX-512 (its dots
    split the key axis in a way no offset tried, 16-64, avoided). The "cpu" kernel sums each
    row over its keys in visit order, wherever they lie: 0 by construction, and checked."""
    b, kvh, g, s, d, a = batch, 3, 3, KEY_BLOCK, 64, CHAIN_ALIGN
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = (2 * jax.random.normal(ks[0], (b, width, kvh * g, d))).astype(jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, kvh, s, d)).astype(jnp.bfloat16) for key in ks[1:3])
    kb, vb = (jax.random.normal(key, (b, kvh, width, d)).astype(jnp.bfloat16) for key in ks[3:5])
    n = jax.random.randint(ks[5], (b,), 0, s - a - width - 1)
    natural = n[:, None] + 1 + jnp.arange(width)[None]
    write = jax.vmap(lambda c, rows, at: jax.lax.dynamic_update_slice_in_dim(c, rows, at, axis=1))
    attend = jax.jit(functools.partial(cache_attention, implementation=implementation))
    want = attend(q, write(k, kb, n + 1), write(v, vb, n + 1), natural)
    got = attend(q, write(k, kb, n + a + 1), write(v, vb, n + a + 1), natural + a,
                 skip_lo=jnp.broadcast_to(n[:, None] + 1, natural.shape),
                 skip_hi=jnp.broadcast_to(n[:, None] + a + 1, natural.shape))
    return int(np.sum(np.asarray(got, np.float32) != np.asarray(want, np.float32)))


@functools.cache
def two_chains_exact_here(implementation: str = "xla") -> bool:
    """Whether greedy two-chain verify keeps plain decoding's tokens on this backend with this
    attention (measured once per process, about a second). On CPU it is
    `second_chain_mismatches` over two seeds; elsewhere the Pallas kernels serve the verify
    (tested against a dense reference)."""
    if jax.default_backend() != "cpu":
        return True
    return all(second_chain_mismatches(seed, implementation=implementation) == 0 for seed in (7, 8))

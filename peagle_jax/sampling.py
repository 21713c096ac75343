"""Token sampling and lossless speculative verification.

Everything here is pure jnp with static shapes, so it can run inside a jitted
`lax.while_loop`. Sampling settings are per-sequence arrays ([B]) rather than Python
scalars, so one batch can mix greedy and sampled requests with different settings.

Conventions:
  temperature [B] f32   0 means greedy (argmax)
  top_k       [B] i32   0 or >= V means off
  top_p       [B] f32   1.0 means off
  draft_tokens [B, K] are the K speculated tokens; target rows [B, K+1] score the
  positions after each prefix (row K gives the bonus token when all K are accepted).

Verification follows Leviathan et al. 2023 ("Fast Inference from Transformers via
Speculative Decoding") with vLLM's rejection-sampler acceptance rule, so the emitted tokens
are distributed exactly as if sampled from the (processed) target distribution.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

from peagle_jax import kernels


class SamplingParams(NamedTuple):
    """Per-sequence sampling settings (arrays, so changing them never recompiles)."""

    temperature: Float[Array, " B"]
    top_k: Int[Array, " B"]
    top_p: Float[Array, " B"]

    @classmethod
    def full(cls, batch: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> SamplingParams:
        return cls(
            jnp.full((batch,), temperature, jnp.float32),
            jnp.full((batch,), top_k, jnp.int32),
            jnp.full((batch,), top_p, jnp.float32),
        )


def _greedy_rows(temperature: Float[Array, " B"]) -> Array:
    # `<= 0` rather than `== 0` so a stray negative temperature means greedy, not NaN.
    return temperature <= 0.0


def _finite_max(x: Float[Array, "... V"]) -> Float[Array, "... 1"]:
    """Row max with all--inf rows mapped to 0, so `x - max` never produces inf - inf."""
    m = jnp.max(x, axis=-1, keepdims=True)
    return jnp.where(jnp.isfinite(m), m, 0.0)


def greedy_token(logits: Float[Array, "... V"]) -> Int[Array, "..."]:
    """Argmax over the last axis, lowest index on ties (as `jnp.argmax`), int32. It runs on every
    row of every round, so it takes `peagle_jax.kernels.argmax`: the CPU kernel where it serves
    (a row holding a NaN then gets its last index), else an XLA formulation that vectorises."""
    return kernels.argmax(logits)


#: Candidates (largest logits per row) from which top-k and top-p thresholds are read directly.
#: A row whose threshold may lie below them (top-k past them, or a nucleus wider than them) is
#: decided by the exact bisection instead.
THRESHOLD_CANDIDATES = 64


def process_logits(
    logits: Float[Array, "B R V"],
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
) -> Float[Array, "B R V"]:
    """Distribution the sampler draws from: temperature, then top-k, then top-p, renormalised.

    Greedy rows (temperature 0) get the one-hot of the argmax (lowest index on ties).
    Ties at the top-k / top-p boundary are all kept (like HF/vLLM's threshold masking).
    Both thresholds are read from each row's `THRESHOLD_CANDIDATES` largest logits
    (`lax.top_k`: 0.7 ms for 8 rows of 49k on CPU) when they must lie among them: top-k with
    k <= 64, and a nucleus whose mass is reached inside them, as it is for text at usual
    temperatures. Otherwise (a flat distribution from a high temperature or an unfamiliar
    context can spread the nucleus over thousands of tokens) the batch falls back to a
    bisection over the logits' bit patterns (`_smallest_key`): exact whatever the shape, but 32
    passes over the vocabulary (about 10 ms for 8 rows of 49k). A full sort would cost about
    17 ms for 4 rows. Batches without a filter skip both.
    """
    x = logits.astype(jnp.float32)
    v = x.shape[-1]
    greedy = _greedy_rows(temperature)[:, None, None]
    t = jnp.where(greedy, 1.0, temperature.astype(jnp.float32)[:, None, None])
    # Shift by the max *before* dividing: logits / tiny_t alone can overflow to inf, and
    # inf - inf is NaN. After the shift the top token sits at 0 and the rest are <= 0.
    x = (x - _finite_max(x)) / t
    k = top_k.astype(jnp.int32)
    k = jnp.where((k <= 0) | (k >= v), v, k)[:, None, None]
    p = top_p.astype(jnp.float32)[:, None, None]
    # Greedy rows ignore their filters (they are one-hot below).
    by_k, by_p = ~greedy & (k < v), ~greedy & (p < 1.0)
    e = jnp.exp(x)  # x <= 0, so exp cannot overflow

    def filtered(_):
        cand = jax.lax.top_k(x, min(THRESHOLD_CANDIDATES, v))[0]  # [B, R, C], descending
        c = cand.shape[-1]
        k_in_cand = by_k & (k <= c)
        # The k-th largest value (a select and a max over the C candidates: a gather here
        # was lowered into the vocabulary-wide compare and cost 100+ ms on XLA:CPU).
        at_k = jnp.arange(c, dtype=jnp.int32) == jnp.minimum(k, c) - 1
        kth = jnp.max(jnp.where(at_k, cand, -jnp.inf), axis=-1, keepdims=True)
        keep_k = ~k_in_cand | (x >= kth)
        e_k = jnp.where(keep_k, e, 0.0)
        # Mass strictly above each candidate value, within the top-k-kept set: every logit
        # above a candidate's value is itself a candidate, so the exclusive prefix sum over
        # the sorted candidates gives it (exactly at the first of a tie group, more after it,
        # which never changes the smallest qualifying value: the group's first qualifies first).
        cand_e = jnp.where(~k_in_cand | (cand >= kth), jnp.exp(cand), 0.0)
        mass_above = (jnp.cumsum(cand_e, axis=-1) - cand_e) / jnp.sum(e_k, axis=-1, keepdims=True)
        # Without the barrier XLA:CPU fuses the vocabulary-wide sum into the reduction below
        # and recomputes it per candidate (70-150 ms instead of about 1 ms for 8 rows of 49k).
        cand, mass_above = jax.lax.optimization_barrier((cand, mass_above))
        # The last kept value is the smallest value with less than top_p of the mass above it
        # (the top value has none above it: a top_p <= 0 keeps just it, and its ties).
        last = jnp.min(jnp.where(mass_above < p, cand, jnp.inf), axis=-1, keepdims=True)
        last = jnp.minimum(last, cand[..., :1])
        # Exact from the candidates when no logit below them can be kept: the smallest
        # candidate's value does not qualify (its group's first member carries its true mass).
        p_in_cand = ~by_p | k_in_cand | (last > cand[..., -1:])
        fast = (~by_k | k_in_cand) & p_in_cand
        keep_fast = keep_k & (~by_p | (x >= last))
        return jax.lax.cond(jnp.all(fast), lambda: keep_fast, lambda: _bisected_keep(x, e, by_k, by_p, k, p))

    keep = jax.lax.cond(jnp.any(by_k | by_p), filtered, lambda _: jnp.ones(x.shape, bool), None)
    e = jnp.where(keep, e, 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(greedy_token(logits), v, dtype=jnp.float32)
    # total == 0 only for a row with no finite logit; fall back to argmax instead of NaN.
    probs = jnp.where(total > 0, e / jnp.where(total > 0, total, 1.0), one_hot)
    return jnp.where(greedy, one_hot, probs)


def _bisected_keep(x, e, by_k, by_p, k, p) -> Bool[Array, "B R V"]:
    """The top-k and top-p kept sets by bisection over bit patterns: exact for any distribution."""
    key = _order_key(x)

    def top_k_keep(_):
        # The k-th largest logit is the smallest c with fewer than k logits above it.
        kth = _smallest_key(key, lambda c: jnp.sum(key > c, axis=-1, keepdims=True) < k)
        return ~by_k | (key >= kth)

    keep = jax.lax.cond(jnp.any(by_k), top_k_keep, lambda _: jnp.ones(x.shape, bool), None)
    # Nucleus over the top-k-kept set: the last kept logit is the smallest c with less than
    # top_p of the mass strictly above it.
    e = jnp.where(keep, e, 0.0)
    mass = e / jnp.sum(e, axis=-1, keepdims=True)
    last = _smallest_key(key, lambda c: jnp.sum(jnp.where(key > c, mass, 0.0), axis=-1, keepdims=True) < p)
    return keep & (~by_p | (key >= last))


def _order_key(x: Float[Array, "... V"]) -> Array:
    """uint32 keys that order like the float32 values (both zeros map to one key; NaN aside)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    key = jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))
    return jnp.where(x == 0, jnp.uint32(0x80000000), key)


def _smallest_key(key, holds) -> Array:
    """Per row, the smallest c (a uint32 key, [..., 1]) with holds(c) True, for a predicate that
    turns from False to True once as c grows and holds at the row's largest key. 32 halvings of
    the key range: every row of the batch converges in the same fixed number of steps."""
    hi = jnp.max(key, axis=-1, keepdims=True)  # holds here by assumption
    lo = jnp.zeros_like(hi)  # below every logit's key; treated as failing

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = holds(mid)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    lo, hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return jnp.where(holds(lo), lo, hi)


# Every function that draws random numbers takes either one key for the whole batch or one
# key per sequence (shape [B]); per-sequence keys make a request's samples depend only on its
# own seed, whatever else shares the batch (the server's `seed` parameter). Keys are typed
# (`jax.random.key`); raw uint32 keys (`jax.random.PRNGKey`) do not fit, as `key.ndim` tells
# the two cases apart.
Keys = Key[Array, ""] | Key[Array, " B"]


def split_keys(key: Keys, num: int) -> Key[Array, " N"] | Key[Array, "N B"]:
    """`num` keys, indexable as out[i]: shape [num] for one key, [num, B] for per-row keys."""
    if key.ndim == 0:
        return jax.random.split(key, num)
    return jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, num))(key), 1, 0)


#: `sample_from_probs` walks the vocabulary in blocks of this many tokens.
SAMPLE_BLOCK = 256


def sample_from_probs(key: Keys, probs: Float[Array, "B R V"]) -> Int[Array, "B R"]:
    """Categorical draw per row. Probs need not be normalised; zero-prob tokens are never drawn.

    Inverse CDF with ONE uniform per row, in two levels: find the block of SAMPLE_BLOCK tokens
    whose cumulative mass crosses u * total, then the token inside it. A Gumbel-max race needs
    V random numbers and a log per row; on CPU that cost 2-3 ms per row for a 49k vocabulary,
    this about 0.1 ms (measured in the sampled verify, where it runs K + 1 times per round).
    Float rounding can put u * total past the last cumulative sum; the draw then falls back to
    the last token with non-zero probability, never to a zero-probability one.
    """
    *lead, v = probs.shape
    nb = -(-v // SAMPLE_BLOCK)
    p = jnp.maximum(probs.astype(jnp.float32), 0.0)
    p = jnp.pad(p, [(0, 0)] * len(lead) + [(0, nb * SAMPLE_BLOCK - v)])
    blocks = p.reshape(*lead, nb, SAMPLE_BLOCK)
    block_mass = jnp.sum(blocks, axis=-1)
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    u = _uniform(key, tuple(lead))
    t = (u * block_cdf[..., -1])[..., None]
    blk = _first_valid_hit(block_cdf > t, block_mass > 0)
    row = jnp.take_along_axis(blocks, blk[..., None, None], axis=-2)[..., 0, :]
    before = jnp.take_along_axis(block_cdf - block_mass, blk[..., None], axis=-1)
    j = _first_valid_hit(before + jnp.cumsum(row, axis=-1) > t, row > 0)
    return (blk * SAMPLE_BLOCK + j).astype(jnp.int32)


def _first_valid_hit(hit: Array, valid: Array) -> Int[Array, "..."]:
    """Index of the first position that is both hit and valid; the last valid one if none is."""
    ok = hit & valid
    last = valid.shape[-1] - 1 - jnp.argmax(valid[..., ::-1], axis=-1)
    return jnp.where(jnp.any(ok, axis=-1), jnp.argmax(ok, axis=-1), last)


def _uniform(key: Keys, shape: tuple[int, ...]) -> Float[Array, "..."]:
    """Uniforms in [0, 1). With per-row keys, element i of a row comes from the row's key folded
    with i, so it does not depend on how many are drawn: a round verifies as many drafts as its
    widest row needs, and a row's draws must not change with what else shares the batch."""
    if key.ndim == 0:
        return jax.random.uniform(key, shape, dtype=jnp.float32)
    rest = shape[1:]
    index = jnp.arange(math.prod(rest), dtype=jnp.uint32)

    def row(k):
        draw = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(k, i), (), dtype=jnp.float32))
        return draw(index).reshape(rest)

    return jax.vmap(row)(key)


def _num_accepted(accept: Array) -> Int[Array, " B"]:
    """Length of the all-True prefix of accept [B, K] (= index of the first rejection)."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _within(limit: Int[Array, " B"] | None, k: int) -> Array | bool:
    """[B, K] mask of the draft positions a row's limit lets count (True without a limit)."""
    return True if limit is None else jnp.arange(k)[None, :] < limit[:, None]


def accept_greedy(
    draft_tokens: Int[Array, "B K"],
    target_logits: Float[Array, "B K1 V"],
    limit: Int[Array, " B"] | None = None,
) -> tuple[Int[Array, " B"], Int[Array, " B"]]:
    """Greedy verification: accept the longest prefix matching the target argmax.

    Returns (num_accepted, next_token); next_token is the target argmax at row
    num_accepted: the correction token, or the bonus token when all K are accepted.
    `limit` (per row, 0..K) caps the drafts a row may accept, as if only that many had been
    proposed: a row with limit 0 decodes one token, exactly as without speculation.
    """
    target_top = greedy_token(target_logits)  # [B, K+1]
    k = draft_tokens.shape[1]
    n = _num_accepted((draft_tokens == target_top[:, :k]) & _within(limit, k))
    return n, jnp.take_along_axis(target_top, n[:, None], axis=1)[:, 0]


def accept_rejection(
    key: Keys,
    draft_tokens: Int[Array, "B K"],
    draft_probs: Float[Array, "B K V"] | None,
    target_probs: Float[Array, "B K1 V"],
    limit: Int[Array, " B"] | None = None,
) -> tuple[Int[Array, " B"], Int[Array, " B"]]:
    """Exact speculative sampling: emitted tokens are distributed as target_probs.

    Draft x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection a token is drawn from norm(max(0, p_i - q_i)) and the round stops; if all
    K are accepted a bonus token is drawn from p_K. draft_probs=None means deterministic
    drafts (q_i one-hot on x_i). Returns (num_accepted, next_token).
    `limit` (per row, 0..K): only the first `limit` drafts are tested; a row that accepts
    them all draws its bonus token from p_limit, as if only `limit` had been proposed.
    """
    b, k = draft_tokens.shape
    v = target_probs.shape[-1]
    key_u, key_s = split_keys(key, 2)
    p = target_probs.astype(jnp.float32)
    x = draft_tokens.astype(jnp.int32)

    # All K acceptance tests at once. u in (0, 1] (not [0, 1)): with u == 0 possible,
    # "p/q >= u" would accept a draft the target gives probability 0. Testing p >= u*q
    # avoids the division and is equivalent for q > 0.
    u = 1.0 - _uniform(key_u, (b, k))
    p_x = jnp.take_along_axis(p[:, :k], x[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_x = jnp.ones_like(p_x)
    else:
        q_x = jnp.take_along_axis(draft_probs.astype(jnp.float32), x[..., None], axis=-1)[..., 0]
    n = _num_accepted((q_x > 0) & (p_x >= u * q_x) & _within(limit, k))

    # Only the row at index n is ever sampled from, so gather it instead of building all K
    # residuals. With q := 0 at row K the residual max(0, p_K - 0) is p_K: the bonus token
    # falls out of the same formula.
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    in_chain = (n < (k if limit is None else limit))[:, None]  # a rejected draft, not a bonus row
    if draft_probs is None:
        # One-hot q: max(0, p - onehot(x)) is p with x zeroed (p(x) <= 1).
        x_n = jnp.take_along_axis(x, jnp.minimum(n, k - 1)[:, None], axis=1)[:, 0]
        q_n = jax.nn.one_hot(x_n, v, dtype=jnp.float32)
    else:
        q_n = jnp.take_along_axis(
            draft_probs.astype(jnp.float32), jnp.minimum(n, k - 1)[:, None, None], axis=1
        )[:, 0]
    residual = jnp.maximum(p_n - jnp.where(in_chain, q_n, 0.0), 0.0)
    # p == q (numerically) leaves no residual mass; p itself is then the right fallback.
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
    return n, sample_from_probs(key_s, residual[:, None, :])[:, 0]


def verify(
    key: Keys,
    draft_tokens: Int[Array, "B K"],
    draft_probs: Float[Array, "B K V"] | None,
    target_logits: Float[Array, "B K1 V"],
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
    limit: Int[Array, " B"] | None = None,
) -> tuple[Int[Array, " B"], Int[Array, " B"]]:
    """Per-sequence verification: greedy rows by argmax match, others by rejection sampling
    (`limit`: the drafts each row may accept, see `accept_greedy`)."""
    n_g, t_g = accept_greedy(draft_tokens, target_logits, limit)
    target_probs = process_logits(target_logits, temperature, top_k, top_p)
    n_s, t_s = accept_rejection(key, draft_tokens, draft_probs, target_probs, limit)
    greedy = _greedy_rows(temperature)
    return jnp.where(greedy, n_g, n_s), jnp.where(greedy, t_g, t_s)


def draft_from_logits(
    key: Keys,
    draft_logits: Float[Array, "B K V"],
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
) -> tuple[Int[Array, "B K"], Float[Array, "B K V"]]:
    """Draft tokens and their distribution q, processed with the target's settings.

    Greedy rows take the argmax (q one-hot). The K rows are sampled independently,
    since P-EAGLE drafts the K slots in parallel.
    """
    probs = process_logits(draft_logits, temperature, top_k, top_p)
    sampled = sample_from_probs(key, probs)
    greedy = _greedy_rows(temperature)[:, None]
    tokens = jnp.where(greedy, greedy_token(draft_logits), sampled)
    return tokens, probs

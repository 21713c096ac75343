"""A trained head and prompt lookup together, one branch per round ("peagle+ngram",
"eagle3+ngram").

A head predicts language; prompt lookup predicts spans the context already holds. Each round
both propose, and each sequence takes the n-gram drafts where its context has a match and the
head's drafts elsewhere; ONE target forward then verifies them. The head still reads every
round's accepted rows (its KV cache must follow the sequence whichever branch won), and its
P-EAGLE forward is the same single pass either way.

The two branches need not draft the same number of tokens. A lookup match tends to copy a
long span, while a small head is right mostly on its first draft, and every verified row
costs target compute. With `head_draft_tokens` = k_h < K the head drafts k_h tokens, a
lookup match K, and the round verifies k_h + 1 rows when no active sequence has a match
(one compiled verify per width, `generate.steps`).

A round where every active sequence has a lookup match does not need the head's drafts, and
on this CPU the head's pass costs about 0.2 decode steps. Such a round skips the head
(`lax.cond`): the rows it accepted wait in a `Deferred` buffer of `defer_rows` rows, and the
next round that runs the head feeds it the waiting rows and the new ones in one pass (the
head's KV cache is then exactly what it would have been, written later). When the buffer could
not take another round's rows, the head runs even where the lookup matches.

The choice depends only on the tokens so far, never on this round's random draws, so sampled
decoding stays exact: rows on the n-gram branch carry a point-mass q at their drafts, the
others the head's q. That is the one-branch-per-round rule, exact for greedy and sampling.

With `two_chains` (greedy rounds only), a sequence whose lookup matches does not have to
choose: the head's k_h drafts are the main chain and the lookup's K a second chain from the
same root, both verified in ONE target forward (`generate.tree`), and the longer accepted
prefix wins. The head then runs every round (nothing is deferred). Sampled rounds keep the
one-branch rule: an exact acceptance rule over two chains of different drafters is not built.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from peagle_jax.cache import KVCache, TokenHistory
from peagle_jax.drafters.drafting import Branch, DraftSettings, Pending, Proposal, Proposer, pad_rows
from peagle_jax.drafters.ngram import NgramProposer


class Deferred(NamedTuple):
    """Accepted rows the head has not read yet (rounds the lookup drafted alone), in order."""

    tokens: Int[Array, "B D"]
    feats: Float[Array, "B D H"]
    count: Int[Array, " B"]
    base: Int[Array, " B"]  # position of row 0


class HybridCache(NamedTuple):
    head: KVCache
    history: TokenHistory
    deferred: Deferred


def _with_deferred(d: Deferred, p: Pending) -> Pending:
    """The waiting rows followed by this round's, as one Pending of width D + W."""
    dw = d.tokens.shape[1]
    m = dw + p.tokens.shape[1]
    j = jnp.arange(m)[None, :]
    src = jnp.clip(jnp.where(j < d.count[:, None], j, dw + j - d.count[:, None]), 0, m - 1)
    tokens = jnp.take_along_axis(jnp.concatenate([d.tokens, p.tokens], axis=1), src, axis=1)
    feats = jnp.concatenate([d.feats, p.feats.astype(d.feats.dtype)], axis=1)
    feats = jnp.take_along_axis(feats, src[..., None], axis=1)
    return Pending(tokens, feats, d.count + p.count, jnp.where(d.count > 0, d.base, p.base), p.active)


class HybridProposer(nnx.Module):
    """A `Proposer`: the n-gram branch where the context matches, the head's elsewhere."""

    def __init__(self, head: Proposer, ngram: NgramProposer, head_draft_tokens: int | None = None,
                 defer_rows: int = 16, two_chains: bool = False):
        """head_draft_tokens: drafts the head proposes where the lookup has no match (None: K,
        the same as a lookup match; larger values are capped at K). defer_rows: accepted rows
        that may wait for the head while the lookup drafts alone (0: the head runs every round;
        a round accepts up to K+1 rows, so fewer than K+1 never skips). two_chains: in greedy
        rounds, verify the head's and the lookup's drafts together (see the module docstring)."""
        if not head.uses_features:
            raise ValueError("the hybrid pairs a feature-reading head (EAGLE-3 / P-EAGLE) with prompt lookup")
        if head_draft_tokens is not None and head_draft_tokens < 1:
            raise ValueError(f"head_draft_tokens must be >= 1 (or None for K), got {head_draft_tokens}")
        if defer_rows < 0:
            raise ValueError(f"defer_rows must be >= 0, got {defer_rows}")
        self.head = head
        self.ngram = ngram
        self.head_draft_tokens = head_draft_tokens
        self.defer_rows = defer_rows
        self.two_chains = two_chains

    uses_features = True

    @property
    def can_draft_parallel(self) -> bool:
        return self.head.can_draft_parallel

    def project(self, aux: Float[Array, "B T A"]) -> Float[Array, "B T H"]:
        return self.head.project(aux)

    def init_cache(self, batch_size: int, capacity: int) -> HybridCache:
        b, d = batch_size, self.defer_rows
        feat = self.head.feature_spec  # the pending rows' feature width and dtype
        deferred = Deferred(jnp.zeros((b, d), jnp.int32), jnp.zeros((b, d, feat.shape[-1]), feat.dtype),
                            jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32))
        return HybridCache(self.head.init_cache(b, capacity), self.ngram.init_cache(b, capacity), deferred)

    def prefill(self, cache: HybridCache, tokens: Int[Array, "B T"], feats: Float[Array, "B T H"] | None,
                positions: Int[Array, "B T"]) -> HybridCache:
        return HybridCache(self.head.prefill(cache.head, tokens, feats, positions),
                           self.ngram.prefill(cache.history, tokens, None, positions), cache.deferred)

    def head_drafts(self, num_draft_tokens: int) -> int:
        """k_h: the drafts the head proposes in a round of K = num_draft_tokens."""
        return num_draft_tokens if self.head_draft_tokens is None else min(self.head_draft_tokens, num_draft_tokens)

    def propose(self, cache: HybridCache, pending: Pending, settings: DraftSettings) -> Proposal:
        k = settings.num_draft_tokens
        k_head = self.head_drafts(k)
        lookup = self.ngram.propose(cache.history, pending, settings)
        if self.two_chains and settings.greedy:  # both chains, one forward
            head = self.head.propose(cache.head, pending, settings._replace(num_draft_tokens=k_head))
            return Proposal(pad_rows(head.tokens, k), None, HybridCache(head.cache, lookup.cache, cache.deferred),
                            jnp.full_like(lookup.num_drafts, k_head), (k_head,),
                            Branch(lookup.tokens, lookup.num_drafts))
        use_lookup = lookup.num_drafts > 0
        active = jnp.ones_like(use_lookup) if pending.active is None else pending.active
        deferred = cache.deferred
        num_drafts = jnp.where(use_lookup, k, k_head).astype(jnp.int32)
        widths = tuple(sorted({k_head, k}))
        point = None if settings.greedy else jax.nn.one_hot(lookup.tokens, settings.vocab, dtype=jnp.float32)

        def with_head(_):
            def fresh(_):  # nothing waits: the head reads this round's rows only
                return self.head.propose(cache.head, pending, settings._replace(num_draft_tokens=k_head))

            def catch_up(_):  # the waiting rows first, then this round's, in one pass
                merged = _with_deferred(deferred, pending)
                return self.head.propose(cache.head, merged, settings._replace(num_draft_tokens=k_head))

            head = fresh(None) if self.defer_rows == 0 else jax.lax.cond(jnp.any(deferred.count > 0), catch_up,
                                                                           fresh, None)
            tokens = jnp.where(use_lookup[:, None], lookup.tokens, pad_rows(head.tokens, k))
            q = None if point is None else jnp.where(use_lookup[:, None, None], point, pad_rows(head.q, k))
            return tokens, q, head.cache, deferred._replace(count=jnp.zeros_like(deferred.count))

        def lookup_only(_):  # every active sequence matched: this round's rows wait for the head
            merged = _with_deferred(deferred, pending)
            waiting = Deferred(merged.tokens[:, :self.defer_rows], merged.feats[:, :self.defer_rows],
                               merged.count, merged.base)
            waiting = jax.tree.map(lambda new, old: _rows_where(active, new, old), waiting, deferred)
            return lookup.tokens, point, cache.head, waiting

        if self.defer_rows < pending.tokens.shape[1]:  # no round's rows could wait
            tokens, q, head_cache, deferred = with_head(None)
        else:
            fits = deferred.count + pending.count <= self.defer_rows
            skip = jnp.all(~active | (use_lookup & fits))
            tokens, q, head_cache, deferred = jax.lax.cond(skip, lookup_only, with_head, None)
        return Proposal(tokens, q, HybridCache(head_cache, lookup.cache, deferred), num_drafts, widths)


def _rows_where(mask: Bool[Array, " B"], new: Array, old: Array) -> Array:
    return jnp.where(mask.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)

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

The choice depends only on the tokens so far, never on this round's random draws, so sampled
decoding stays exact: rows on the n-gram branch carry a point-mass q at their drafts, the
others the head's q. Verifying both branches in one tree-masked forward is the planned next
step; this is its one-branch-per-round fallback.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from peagle_jax.cache import KVCache, TokenHistory
from peagle_jax.drafters.drafting import DraftSettings, Pending, Proposal, Proposer, pad_rows
from peagle_jax.drafters.ngram import NgramProposer


class HybridCache(NamedTuple):
    head: KVCache
    history: TokenHistory


class HybridProposer(nnx.Module):
    """A `Proposer`: the n-gram branch where the context matches, the head's elsewhere."""

    def __init__(self, head: Proposer, ngram: NgramProposer, head_draft_tokens: int | None = None):
        """head_draft_tokens: drafts the head proposes where the lookup has no match (None: K,
        the same as a lookup match; larger values are capped at K)."""
        if not head.uses_features:
            raise ValueError("the hybrid pairs a feature-reading head (EAGLE-3 / P-EAGLE) with prompt lookup")
        if head_draft_tokens is not None and head_draft_tokens < 1:
            raise ValueError(f"head_draft_tokens must be >= 1 (or None for K), got {head_draft_tokens}")
        self.head = head
        self.ngram = ngram
        self.head_draft_tokens = head_draft_tokens

    uses_features = True

    @property
    def can_draft_parallel(self) -> bool:
        return self.head.can_draft_parallel

    def project(self, aux: Float[Array, "B T A"]) -> Float[Array, "B T H"]:
        return self.head.project(aux)

    def prefill(self, tokens: Int[Array, "B T"], feats: Float[Array, "B T H"] | None, positions: Int[Array, "B T"],
                capacity: int) -> HybridCache:
        return HybridCache(self.head.prefill(tokens, feats, positions, capacity),
                           self.ngram.prefill(tokens, None, positions, capacity))

    def head_drafts(self, num_draft_tokens: int) -> int:
        """k_h: the drafts the head proposes in a round of K = num_draft_tokens."""
        return num_draft_tokens if self.head_draft_tokens is None else min(self.head_draft_tokens, num_draft_tokens)

    def propose(self, cache: HybridCache, pending: Pending, settings: DraftSettings) -> Proposal:
        k = settings.num_draft_tokens
        k_head = self.head_drafts(k)
        head = self.head.propose(cache.head, pending, settings._replace(num_draft_tokens=k_head))
        lookup = self.ngram.propose(cache.history, pending, settings)
        use_lookup = lookup.num_drafts > 0
        tokens = jnp.where(use_lookup[:, None], lookup.tokens, pad_rows(head.tokens, k))
        q = head.q
        if q is not None:  # sampling: the n-gram rows' q is a point mass at their drafts
            point = jax.nn.one_hot(lookup.tokens, q.shape[-1], dtype=q.dtype)
            q = jnp.where(use_lookup[:, None, None], point, pad_rows(q, k))
        num_drafts = jnp.where(use_lookup, k, k_head).astype(jnp.int32)
        return Proposal(tokens, q, HybridCache(head.cache, lookup.cache), num_drafts, tuple(sorted({k_head, k})))

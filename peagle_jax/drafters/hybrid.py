"""A trained head and prompt lookup together, one branch per round ("peagle+ngram",
"eagle3+ngram").

A head predicts language; prompt lookup predicts spans the context already holds. Each round
both propose, and each sequence takes the n-gram drafts where its context has a match and the
head's drafts elsewhere; ONE target forward then verifies the chosen K. The head still reads
every round's accepted rows (its KV cache must follow the sequence whichever branch won), and
its P-EAGLE forward is the same single pass either way.

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
from peagle_jax.drafters.drafting import DraftSettings, Pending, Proposal, Proposer
from peagle_jax.drafters.ngram import NgramProposer


class HybridCache(NamedTuple):
    head: KVCache
    history: TokenHistory


class HybridProposer(nnx.Module):
    """A `Proposer`: the n-gram branch where the context matches, the head's elsewhere."""

    def __init__(self, head: Proposer, ngram: NgramProposer):
        if not head.uses_features:
            raise ValueError("the hybrid pairs a feature-reading head (EAGLE-3 / P-EAGLE) with prompt lookup")
        self.head = head
        self.ngram = ngram

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

    def propose(self, cache: HybridCache, pending: Pending, settings: DraftSettings) -> Proposal:
        head = self.head.propose(cache.head, pending, settings)
        lookup = self.ngram.propose(cache.history, pending, settings)
        use_lookup = lookup.has_drafts
        tokens = jnp.where(use_lookup[:, None], lookup.tokens, head.tokens)
        q = head.q
        if q is not None:  # sampling: the n-gram rows' q is a point mass at their drafts
            point = jax.nn.one_hot(lookup.tokens, q.shape[-1], dtype=q.dtype)
            q = jnp.where(use_lookup[:, None, None], point, q)
        return Proposal(tokens, q, HybridCache(head.cache, lookup.cache))

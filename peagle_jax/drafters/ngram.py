"""Prompt-lookup (n-gram) drafting: the K tokens that followed the latest earlier occurrence of
the context's last n tokens.

A trained head predicts language; it cannot predict a span the user pasted. Summaries, edits
of pasted code, answers quoting a document and greedy repetition loops copy from the context,
and there the context itself is the best drafter, at no model cost. This one runs on device
with static shapes inside the jitted round:

  * the history is a `TokenHistory` (row p = token p + 1), filled by `prefill` with the prompt
    and by `propose` with each round's accepted tokens;
  * for n from `max_n` down to `min_n`, the latest position j < L - 1 whose n tokens equal the
    last n tokens is a match; the longest n with a match wins (vLLM's prompt lookup picks
    the longest n too);
  * the drafts continue the match periodically, token j + 1 + (k mod p) with period
    p = L - 1 - j, so a match that ends just before the suffix (a repetition loop) still
    proposes K tokens instead of reading rows that do not exist yet;
  * a sequence without a match proposes no drafts (`num_drafts` 0, widths (0, K)); when no
    active sequence has one, `generate.steps.spec_round` runs a plain 1-row decode step
    instead of a verify.

The drafts are a point mass (q None), so greedy acceptance and exact rejection sampling
both apply unchanged: accepting draft d with probability p(d) keeps sampling exact.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from peagle_jax.cache import TokenHistory
from peagle_jax.drafters.drafting import DraftSettings, Pending, Proposal


def match_ngram(
    history: Int[Array, "B S"], length: Int[Array, " B"], num_draft_tokens: int, min_n: int, max_n: int
) -> tuple[Int[Array, "B K"], Bool[Array, " B"]]:
    """K drafts per sequence from the longest, latest earlier match of the last n tokens.

    history rows [0, length) are valid; the suffix is rows length-n .. length-1. Returns the
    drafts (the last token repeated where there is no match) and whether there was a match.
    """
    b, s = history.shape
    j = jnp.arange(s)[None, :]  # candidate end row of an earlier occurrence
    last = length[:, None] - 1
    best_end = jnp.full((b,), -1, jnp.int32)
    for n in range(min_n, max_n + 1):  # longer n overrides shorter: the longest match wins
        ok = (j >= n - 1) & (j < last) & (last - n + 1 >= 0)
        for i in range(n):
            suffix_tok = jnp.take_along_axis(history, jnp.maximum(last - i, 0), axis=1)  # [B, 1]
            cand_tok = jnp.take_along_axis(history, jnp.maximum(j - i, 0).repeat(b, 0), axis=1)
            ok = ok & (cand_tok == suffix_tok)
        end = jnp.max(jnp.where(ok, j, -1), axis=1)  # latest occurrence
        best_end = jnp.where(end >= 0, end, best_end)
    has = best_end >= 0
    period = jnp.maximum(last[:, 0] - best_end, 1)
    k = jnp.arange(num_draft_tokens)[None, :]
    rows = best_end[:, None] + 1 + k % period[:, None]
    rows = jnp.where(has[:, None], rows, last)
    drafts = jnp.take_along_axis(history, jnp.clip(rows, 0, s - 1), axis=1)
    return drafts, has


class NgramProposer(nnx.Module):
    """A `Proposer` that drafts from the context (prompt lookup); no weights, no features."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    @property
    def can_draft_parallel(self) -> bool:
        return False

    uses_features = False

    def project(self, aux: Float[Array, "B T A"]) -> Float[Array, "B T H"]:
        raise TypeError("NgramProposer reads tokens, not target features")

    def init_cache(self, batch_size: int, capacity: int) -> TokenHistory:
        return TokenHistory(jnp.zeros((batch_size, capacity), jnp.int32))

    def prefill(self, cache: TokenHistory, tokens: Int[Array, "B T"], feats: Float[Array, "B T H"] | None,
                positions: Int[Array, "B T"]) -> TokenHistory:
        """The history with the prompt written in (rows past a prompt are overwritten later)."""
        return cache.write(tokens, positions)

    def propose(self, cache: TokenHistory, pending: Pending, settings: DraftSettings) -> Proposal:
        w = pending.tokens.shape[1]
        j = jnp.arange(w)[None, :]
        rows = jnp.where(j < pending.count[:, None], pending.base[:, None] + j, cache.capacity)
        history = cache.write(pending.tokens, rows)
        drafts, has = match_ngram(history.tokens, pending.base + pending.count, settings.num_draft_tokens,
                                  self.min_n, self.max_n)
        k = settings.num_draft_tokens
        return Proposal(drafts, None, history, jnp.where(has, k, 0).astype(jnp.int32), (0, k))

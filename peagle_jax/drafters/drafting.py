"""How a drafter takes part in a speculative round: the proposer interface and its inputs.

A round needs these from a drafter, whatever it is (a learned EAGLE-3 / P-EAGLE head,
the prompt-lookup drafter of `drafters.ngram`, or the replay oracle of the tests and
synthetic benchmarks):
  project   the target's concatenated feature taps -> the drafter's feature space;
  init_cache / prefill
            an empty drafter cache, then the prompt's drafter rows written into it (in one
            call, or chunk by chunk for a long prompt);
  propose   a `Proposal`: K draft tokens (and, when sampling, their probabilities q over
            the target vocabulary) from the rows accepted in the last round, and which
            many drafts each sequence has (a context drafter may find nothing to propose).
`generate.steps` only calls these, so a new kind of drafter plugs in without touching it.

The two ways an EAGLE-3 head drafts live here too:
  draft_parallel    P-EAGLE: ONE forward over [C pending rows | K-1 mask slots];
  draft_sequential  EAGLE-3: one forward over the pending rows, then K-1 single-row
                    forwards feeding back the drafted token and the pre-norm hidden state.
Either can also propose the head's second choice for the first draft (`second_choice`), a
one-token second chain the round verifies in the same target forward (`generate.tree`), or
stop its chain where the head is no longer confident (`confident_drafts`), so the round
verifies only the drafts worth a verify row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from peagle_jax import sampling
from peagle_jax.cache import KVCache
from peagle_jax.sampling import SamplingParams

if TYPE_CHECKING:
    from peagle_jax.drafters.eagle3 import Eagle3Drafter


class Pending(NamedTuple):
    """The rows the next draft step feeds to the drafter (see `generate.steps`)."""

    tokens: Int[Array, "B W"]
    feats: Float[Array, "B W H"] | None  # None for drafters that read no target features
    count: Int[Array, " B"]  # C valid rows per sequence
    base: Int[Array, " B"]  # position of row 0 (n_b - C)
    active: Bool[Array, " B"] | None = None  # sequences still generating (a finished one's rows are stale)


class DraftSettings(NamedTuple):
    """What every draft step needs besides the drafter, its cache and the pending rows."""

    num_draft_tokens: int  # K
    parallel: bool  # P-EAGLE (one forward) or EAGLE-3 (K sequential forwards)
    key: jax.Array
    sampling: SamplingParams
    greedy: bool
    vocab: int  # target vocabulary size (q is scattered to it when sampling)
    out_len: Int[Array, " B"]  # tokens emitted so far: where replaying drafters read


class Branch(NamedTuple):
    """A second chain of drafts from the same root as the main one (greedy rounds only).

    The round verifies both chains in one target forward (`generate.tree`) and keeps the
    longer accepted prefix; a sequence with `num_drafts` 0 has no second chain this round.
    """

    tokens: Int[Array, "B W"]
    num_drafts: Int[Array, " B"]


class Proposal(NamedTuple):
    """One round's drafts from a `Proposer`.

    A proposer may propose fewer than K drafts for some sequences (prompt lookup without a
    match proposes none; a hybrid proposes the head's few or the lookup's K): `num_drafts`
    says how many per sequence, and `widths` lists, as static ints, every value it can take.
    The round then verifies only as many rows as the longest active proposal needs, with one
    compiled verify per width (`generate.steps`), instead of always K+1 rows.
    """

    tokens: Int[Array, "B K"]  # drafts in target ids (rows past num_drafts are ignored)
    q: Float[Array, "B K V"] | None  # their distribution over the target vocabulary; None: a point mass
    cache: Any  # the drafter's new cache (KVCache, TokenHistory) or None
    num_drafts: Int[Array, " B"] | None = None  # drafts proposed per sequence, 0..K; None: K for all
    widths: tuple[int, ...] | None = None  # the static values num_drafts takes (None: just K)
    branch: Branch | None = None  # a second chain verified beside this one (greedy), or None


@runtime_checkable
class Proposer(Protocol):
    """The drafter side of a speculative round (implemented by every drafter)."""

    @property
    def can_draft_parallel(self) -> bool:
        """Whether `propose` can draft P-EAGLE style (settings.parallel)."""
        ...

    @property
    def uses_features(self) -> bool:
        """Whether the drafter reads the target's feature taps (False: `project` is never called,
        the verify skips the taps and `feats` arrive as None)."""
        ...

    def project(self, aux: Float[Array, "B T A"]) -> Float[Array, "B T H"]:
        """Target feature taps -> the features the drafter's pending rows carry."""
        ...

    def init_cache(self, batch_size: int, capacity: int) -> Any:
        """An empty drafter cache of `capacity` rows per sequence (None: the drafter keeps none)."""
        ...

    def prefill(self, cache: Any, tokens: Int[Array, "B T"], feats: Float[Array, "B T H"] | None,
                positions: Int[Array, "B T"]) -> Any:
        """`cache` with prompt rows written at `positions` (row p: token p + 1, feature of p).

        Rows go where their positions say and attention is causal by position, so a long
        prompt can arrive in chunks, each call extending the cache the last one returned.
        """
        ...

    def propose(self, cache: Any, pending: Pending, settings: DraftSettings) -> Proposal:
        """K drafts in target ids, q over the target vocabulary (None when greedy), new cache."""
        ...


def pad_rows(x: jax.Array, rows: int) -> jax.Array:
    """Zero-pad (or cut) axis 1 to `rows`."""
    pad = rows - x.shape[1]
    if pad <= 0:
        return x[:, :rows]
    widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, widths)


def _draft_tokens_from_logits(
    drafter: Eagle3Drafter, logits: Float[Array, "B K Vd"], key, sp: SamplingParams, greedy: bool, vocab: int
) -> tuple[Int[Array, "B K"], Float[Array, "B K V"] | None, Float[Array, "B K"]]:
    """Draft ids (target vocabulary), q over the target vocabulary when sampling, and the head's
    confidence at each draft position for `confident_drafts`: its top-1 probability (softmax at
    temperature 1). That is the greedy draft's probability; in a sampled round it is NOT the
    drawn draft's, on purpose: whether a draft is verified must not depend on which token was
    drawn, or the verified drafts would no longer follow q and rejection sampling would be biased."""
    if greedy:
        draft_ids, q_full = sampling.greedy_token(logits), None
    else:
        draft_ids, q_draft = sampling.draft_from_logits(key, logits, sp.temperature, sp.top_k, sp.top_p)
        # q over the target vocabulary: draft-vocab probabilities scattered to their target ids.
        vocab_ids = drafter.to_target_ids(jnp.arange(logits.shape[-1]))
        q_full = jnp.zeros(logits.shape[:2] + (vocab,), jnp.float32).at[..., vocab_ids].set(q_draft)
    logits32 = logits.astype(jnp.float32)
    confidence = jnp.exp(jnp.max(logits32, axis=-1) - jax.nn.logsumexp(logits32, axis=-1))
    return drafter.to_target_ids(draft_ids), q_full, confidence


def confident_drafts(confidence: Float[Array, "B K"], cutoff: float) -> Int[Array, " B"]:
    """How many leading drafts to verify: the longest chain whose product of the head's top-1
    probabilities stays >= `cutoff` (0 drafts when even the first is below it).

    The product estimates the chance that the whole chain is accepted; the shipped heads are
    calibrated (HumanEval, K=3: rounds whose first draft has p < 0.1 accept it 8% of the time,
    p >= 0.8 75%). A verify row costs a tenth of a decode step on a CPU, so a draft that is
    unlikely to be accepted is cheaper left out; a chain stopped at 0 drafts makes the round a
    plain 1-row decode step (`generate.steps._target_step`). Greedy output stays plain
    decoding's, and sampling stays exact because the confidences depend on the context, not on
    the drafts drawn: fewer drafts are proposed, that is all.
    """
    return jnp.sum(jnp.cumprod(confidence, axis=1) >= cutoff, axis=1).astype(jnp.int32)


def _proposal(drafts, q, cache, confidence, cutoff: float, branch: Branch | None) -> Proposal:
    """A head's Proposal: all K drafts, or with a cutoff the confident prefix (widths 0..K)."""
    if cutoff <= 0.0:
        return Proposal(drafts, q, cache, branch=branch)
    k = drafts.shape[1]
    return Proposal(drafts, q, cache, num_drafts=confident_drafts(confidence, cutoff), widths=tuple(range(k + 1)),
                    branch=branch)


def second_choice(drafter: Eagle3Drafter, logits: Float[Array, "B Vd"]) -> Branch:
    """The head's second choice for the first draft, as a one-token second chain.

    Where the first draft is rejected, the target's token is often the head's runner-up
    (on HumanEval at batch 1 with the shipped P-EAGLE head, K=2: 1.50 -> 1.62 tokens per
    round). Verifying it beside the main chain costs one more verify row, which is cheaper
    than a K+1-th draft that the heads rarely get right. The best id is masked, not taken
    from a top-2, so ties cannot make the runner-up repeat the first draft.
    """
    v = logits.shape[-1]
    best = sampling.greedy_token(logits)
    runner_up = sampling.greedy_token(jnp.where(jnp.arange(v)[None, :] == best[:, None], -jnp.inf, logits))
    return Branch(drafter.to_target_ids(runner_up)[:, None], jnp.ones(best.shape, jnp.int32))


def draft_parallel(drafter: Eagle3Drafter, cache: KVCache, pending: Pending, ds: DraftSettings, *,
                   second_root: bool = False, cutoff: float = 0.0) -> Proposal:
    """P-EAGLE: K drafts from ONE forward over [pending | K-1 mask slots] (with `second_root` in
    greedy rounds also the first draft's runner-up as a second chain; with `cutoff` > 0 only
    the confident prefix of the chain, `confident_drafts`)."""
    cfg = drafter.config
    k = ds.num_draft_tokens
    rows = pending.tokens.shape[1] + k - 1
    j = jnp.arange(rows)[None, :]
    c = pending.count[:, None]
    is_pending = j < c
    tokens = jnp.where(is_pending, pad_rows(pending.tokens, rows), cfg.mask_token_id)
    mask_feat = drafter.mask_feature().astype(pending.feats.dtype)
    feats = jnp.where(is_pending[..., None], pad_rows(pending.feats, rows), mask_feat)
    positions = pending.base[:, None] + j
    logit_rows = c - 1 + jnp.arange(k)[None, :]  # last pending row + K-1 mask rows
    out = drafter(tokens, feats, positions, cache, logit_rows=logit_rows)
    drafts, q, confidence = _draft_tokens_from_logits(drafter, out.logits, ds.key, ds.sampling, ds.greedy, ds.vocab)
    branch = second_choice(drafter, out.logits[:, 0]) if second_root and ds.greedy else None
    return _proposal(drafts, q, out.cache, confidence, cutoff, branch)


def draft_sequential(drafter: Eagle3Drafter, cache: KVCache, pending: Pending, ds: DraftSettings, *,
                     second_root: bool = False, cutoff: float = 0.0) -> Proposal:
    """EAGLE-3: one forward over the pending rows, then K-1 single-row forwards (with
    `second_root` and `cutoff` as in `draft_parallel`)."""
    b, w = pending.tokens.shape
    c = pending.count[:, None]
    positions = pending.base[:, None] + jnp.arange(w)[None, :]
    keys = sampling.split_keys(ds.key, ds.num_draft_tokens)

    def sample(logits, key):
        return _draft_tokens_from_logits(drafter, logits, key, ds.sampling, ds.greedy, ds.vocab)

    out = drafter(pending.tokens, pending.feats, positions, cache, logit_rows=c - 1)
    tok, q, conf = sample(out.logits, keys[0])
    branch = second_choice(drafter, out.logits[:, 0]) if second_root and ds.greedy else None
    hidden = jnp.take_along_axis(out.prenorm, (c - 1)[..., None], axis=1)  # [B, 1, H]
    last_pos = pending.base + pending.count - 1

    def step(carry, i):
        cache, tok, hidden = carry
        o = drafter(tok, hidden, (last_pos + i)[:, None], cache, logit_rows=jnp.zeros((b, 1), jnp.int32))
        nt, nq, nc = sample(o.logits, keys[i])
        return (o.cache, nt, o.prenorm), (nt[:, 0], None if nq is None else nq[:, 0], nc[:, 0])

    cache = out.cache
    if ds.num_draft_tokens == 1:
        return _proposal(tok, q, cache, conf, cutoff, branch)
    (cache, _, _), (toks, qs, confs) = jax.lax.scan(step, (cache, tok, hidden), jnp.arange(1, ds.num_draft_tokens))
    drafts = jnp.concatenate([tok, toks.T], axis=1)
    probs = None if q is None else jnp.concatenate([q, jnp.moveaxis(qs, 0, 1)], axis=1)
    return _proposal(drafts, probs, cache, jnp.concatenate([conf, confs.T], axis=1), cutoff, branch)

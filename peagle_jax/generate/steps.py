"""The pieces of one speculative round, as pure functions over modules and pytrees.

Vocabulary (batch of B sequences, K draft tokens):
  n_b          committed target length: target KV holds positions < n_b
  last_token   the newest emitted token (position n_b); it has no target KV yet
  pending      tokens accepted in the last round (C = m + 1 of them, the last one being
               `last_token`), each paired with the target feature of the position *before*
               it (the EAGLE shift: drafter row p = feature of position p + token p + 1).
               Their drafter KV is written by the next draft step, at positions n_b - C ...

One round = draft -> verify -> accept -> commit:
  draft   P-EAGLE: ONE drafter forward over [C pending | K-1 mask slots] at consecutive
          positions; logits at the last pending row and the K-1 mask rows give K drafts.
          EAGLE-3: one forward over the pending rows, then K-1 single-row forwards that
          feed back the drafted token and the drafter's own pre-norm hidden state.
  verify  ONE target forward over [last_token, d_1..d_K] at positions n_b..n_b+K, also
          returning the three feature taps.
  accept  greedy prefix match or exact rejection sampling -> m accepted + 1 target token.
  commit  append the m+1 tokens; n_b += m+1; the next pending rows are those m+1 tokens
          with the taps of rows 0..m. Rows past n_b (rejected drafts, placeholder KV)
          are simply overwritten later: no copy, no rollback.

Every function has static shapes; finished sequences keep computing but never advance.
`prefill` and `spec_round` are the step API that `speculative_generate` loops over and the
server drives slot by slot. Their static settings are one `SpecConfig` (K is
`num_draft_tokens` everywhere); the drafter is any `drafters.drafting.Proposer`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from peagle_jax import sampling
from peagle_jax.cache import KVCache
from peagle_jax.drafters.drafting import DraftSettings, Pending, Proposal, Proposer, pad_rows
from peagle_jax.generate import tree
from peagle_jax.models.transformer import CausalLM
from peagle_jax.sampling import SamplingParams

Method = Literal["none", "eagle3", "peagle", "ngram", "eagle3+ngram", "peagle+ngram"]
METHODS = ("none", "eagle3", "peagle", "ngram", "eagle3+ngram", "peagle+ngram")
#: Methods whose drafter reads the target's feature taps (the others skip computing them).
FEATURE_METHODS = ("eagle3", "peagle", "eagle3+ngram", "peagle+ngram")
#: Methods that draft P-EAGLE style: K drafts from one head forward.
PARALLEL_METHODS = ("peagle", "peagle+ngram")

#: XLA options for every program that runs these steps. Greedy speculative decoding is exact
#: only if a row gets bitwise the same logits in a 1-row decode step, a K+1-row verify and a
#: batch of B such blocks. XLA:CPU's YNN library fusions merge a dot with neighbouring
#: elementwise and reduce ops into one kernel whose rounding depends on the row count (rows of
#: 2- and 8-row SmolLM2 forwards differed in bf16); keeping them to single dots makes every
#: row's value the same (tests/generate/test_row_invariance.py). It is an xla_cpu_ debug option, meant to
#: be inert elsewhere; that has not yet been checked on a GPU.
STEP_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
#: `jax.jit` with STEP_COMPILER_OPTIONS (use it for anything that calls prefill / spec_round).
step_jit = functools.partial(jax.jit, compiler_options=STEP_COMPILER_OPTIONS)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """The static settings of a speculative program: everything jit specializes on.

    One hashable value instead of loose static arguments, so every jit site (generate, the
    server's prefill and round, the benchmarks) compiles the same program for the same
    settings. `num_draft_tokens` is K, the drafts per round (0 for method "none").
    """

    method: Method
    num_draft_tokens: int
    greedy: bool
    capacity: int  # KV rows per sequence
    out_size: int  # output buffer per sequence
    #: Also compile a plain round, taken when no active sequence may accept a draft (every
    #: draft limit 0: speculation off per request, or chosen off by an adaptive server): a
    #: 1-row decode step without the drafter, see `_plain_round`. Head methods only.
    plain_rounds: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.method == "none" and self.num_draft_tokens != 0:
            raise ValueError(f"method 'none' drafts nothing: num_draft_tokens must be 0, got {self.num_draft_tokens}")
        if self.method != "none" and self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1 for method {self.method!r}, got {self.num_draft_tokens}")
        if self.plain_rounds and self.method not in ("eagle3", "peagle"):
            raise ValueError(f"plain_rounds applies to the head methods eagle3 and peagle, not {self.method!r} "
                             "(n-gram methods already verify no rows where nothing is drafted)")
        if self.capacity < 1 or self.out_size < 1:
            raise ValueError(f"capacity and out_size must be >= 1, got {self.capacity} and {self.out_size}")

    @property
    def uses_drafter(self) -> bool:
        return self.method != "none"

    @property
    def uses_features(self) -> bool:
        """Whether verify and prefill return the feature taps (EAGLE-3 / P-EAGLE heads)."""
        return self.method in FEATURE_METHODS

    def check_drafter(self, drafter: Proposer | None) -> None:
        """A clear error when `drafter` cannot draft for this method."""
        if self.uses_drafter and drafter is None:
            raise ValueError(f"method {self.method!r} needs a drafter")
        if self.method in PARALLEL_METHODS and not drafter.can_draft_parallel:
            raise ValueError(f"method {self.method!r} needs a head built for parallel drafting (P-EAGLE: "
                             "mask_token_id and mask_hidden); this one drafts sequentially only (EAGLE-3)")
        if self.uses_drafter and drafter.uses_features != self.uses_features:
            raise ValueError(f"method {self.method!r} needs a drafter that "
                             f"{'reads' if self.uses_features else 'does not read'} target features; "
                             f"got {type(drafter).__name__}")


class SpecState(NamedTuple):
    """Everything a round needs, per sequence; a pytree carried by `lax.while_loop`."""

    target_cache: KVCache  # lengths = n_b
    drafter_cache: Any  # the drafter's own cache pytree: KVCache (heads), TokenHistory (n-gram), ... or None
    last_token: Int[Array, " B"]
    pending_tokens: Int[Array, "B W"]  # W = K + 1
    pending_feats: Float[Array, "B W H"] | None  # drafter-space features (after fc); None for n-gram
    num_pending: Int[Array, " B"]
    output: Int[Array, "B N"]  # generated tokens (N = output buffer size)
    out_len: Int[Array, " B"]
    max_new: Int[Array, " B"]  # per-sequence token budget (<= N)
    done: Bool[Array, " B"]
    hit_eos: Bool[Array, " B"]
    rounds: Int[Array, " B"]  # target forwards after prefill, while active
    accepted_per_pos: Int[Array, "B K"]  # rounds in which draft position i was accepted
    sampling: SamplingParams
    draft_limit: Int[Array, " B"]  # drafts a sequence may accept per round, 0..K (0: no speculation)
    eos_ids: Int[Array, " E"]
    key: jax.Array  # one PRNG key per sequence, [B]


def pending_rows(state: SpecState) -> Pending:
    """The rows accepted last round, which the next draft step feeds to the drafter."""
    n = state.target_cache.lengths
    return Pending(state.pending_tokens, state.pending_feats, state.num_pending, n - state.num_pending, ~state.done)


def draft_settings(config: SpecConfig, state: SpecState, key: jax.Array, vocab: int) -> DraftSettings:
    """What the drafter needs from the config and the state to propose this round's drafts."""
    return DraftSettings(config.num_draft_tokens, config.method in PARALLEL_METHODS, key, state.sampling, config.greedy,
                         vocab, state.out_len)


# --------------------------------------------------------------------------- target steps


def verify_forward(
    target: CausalLM, cache: KVCache, last_token: Int[Array, " B"], drafts: Int[Array, "B K"], *, return_aux: bool
):
    """ONE target forward over [last_token, d_1..d_K] at positions n..n+K."""
    tokens = jnp.concatenate([last_token[:, None], drafts], axis=1)
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
    return target(tokens, positions, cache, return_aux=return_aux)


def _commit(
    state: SpecState,
    emitted: Int[Array, "B R"],
    num_new: Int[Array, " B"],
    capacity_limit: int,
) -> tuple[Int[Array, "B N"], Int[Array, " B"], Bool[Array, " B"], Bool[Array, " B"]]:
    """Append up to `num_new` tokens per sequence, stopping at EOS and at the budget."""
    r = emitted.shape[1]
    j = jnp.arange(r)[None, :]
    valid = j < num_new[:, None]
    is_eos = jnp.isin(emitted, state.eos_ids) & valid
    any_eos = jnp.any(is_eos, axis=1)
    first_eos = jnp.argmax(is_eos, axis=1)
    count = jnp.where(any_eos, first_eos + 1, num_new)  # EOS itself is emitted
    count = jnp.minimum(count, state.max_new - state.out_len)
    count = jnp.where(state.done, 0, count)
    idx = jnp.where(j < count[:, None], state.out_len[:, None] + j, state.output.shape[1])
    bidx = jnp.arange(emitted.shape[0])[:, None]
    output = state.output.at[bidx, idx].set(emitted, mode="drop")
    out_len = state.out_len + count
    hit_eos = state.hit_eos | (any_eos & (first_eos < count) & ~state.done)
    full = state.target_cache.lengths + num_new + capacity_limit > state.target_cache.capacity
    done = state.done | hit_eos | (out_len >= state.max_new) | full
    return output, out_len, done, hit_eos


def _select(active, new, old):
    m = active.reshape((-1,) + (1,) * (new.ndim - 1))
    return jnp.where(m, new, old)


def _plain_step(target: CausalLM, state: SpecState, key: jax.Array, greedy: bool, *, return_aux: bool = False):
    """Method "none": one 1-row target forward, the next token sampled from it."""
    b = state.last_token.shape[0]
    out = verify_forward(target, state.target_cache, state.last_token, jnp.zeros((b, 0), jnp.int32),
                         return_aux=return_aux)
    if greedy:
        nxt = sampling.greedy_token(out.logits[:, 0])
    else:
        sp = state.sampling
        probs = sampling.process_logits(out.logits, sp.temperature, sp.top_k, sp.top_p)
        # the key a verify with no accepted draft draws its token with (`accept_rejection`)
        nxt = sampling.sample_from_probs(sampling.split_keys(key, 2)[1], probs)[:, 0]
    return out, jnp.zeros_like(nxt), nxt


def _verify_step(target: CausalLM, state: SpecState, proposal: Proposal, key: jax.Array, config: SpecConfig,
                 width: int, limit: Int[Array, " B"]):
    """ONE (width+1)-row target forward over the first `width` drafts, then greedy or exact
    rejection acceptance of at most `limit` of them per sequence."""
    drafts = proposal.tokens[:, :width]
    out = verify_forward(target, state.target_cache, state.last_token, drafts, return_aux=config.uses_features)
    if config.greedy:
        m, nxt = sampling.accept_greedy(drafts, out.logits, limit)
    else:
        sp = state.sampling
        q = None if proposal.q is None else proposal.q[:, :width]
        m, nxt = sampling.verify(key, drafts, q, out.logits, sp.temperature, sp.top_k, sp.top_p, limit)
    return out, m, nxt


def verify_width_index(widths: tuple[int, ...], limit: Int[Array, " B"], active: Bool[Array, " B"]) -> Int[Array, ""]:
    """Index into sorted `widths` of the smallest width that holds every active sequence's drafts."""
    need = jnp.max(jnp.where(active, limit, 0))
    return sum((need > w).astype(jnp.int32) for w in widths[:-1]) if len(widths) > 1 else jnp.int32(0)


def _target_step(target: CausalLM, state: SpecState, proposal: Proposal, key: jax.Array, config: SpecConfig,
                 active: Bool[Array, " B"]):
    """The target's part of a round: (cache, accepted count m, next token, feature taps, drafts).

    A proposer that drafts fewer than K tokens for some sequences (prompt lookup without a
    match, a hybrid whose head drafts few, a head stopped by its confidence cutoff) reports
    `num_drafts` and the static `widths` it
    takes. The round then verifies w+1 rows for the smallest width w that holds every active
    sequence's drafts (capped by its draft limit), w = 0 being a plain 1-row decode step: one
    program per width is compiled and `lax.switch` picks one per round. A sequence accepts at
    most its own num_drafts, exactly as if only those had been proposed, so greedy output
    stays plain decoding's and sampling stays exact whatever width the batch runs.

    A proposal with a second chain (`Proposal.branch`, greedy only) verifies both chains in one
    forward when any active sequence has one that fits (`generate.tree`); `drafts` are then
    each sequence's winning chain.
    """
    k = config.num_draft_tokens
    if proposal.num_drafts is None:  # K drafts for every sequence: one K+1-row verify
        limit, widths = state.draft_limit, (k,)
    else:
        limit, widths = jnp.minimum(state.draft_limit, proposal.num_drafts), tuple(sorted(set(proposal.widths or (k,))))
    if widths[-1] > k or widths[0] < 0:
        raise ValueError(f"proposal widths {widths} must lie in 0..K={k}")

    def branch(w: int):
        def run():
            if w == 0:
                out, m, nxt = _plain_step(target, state, key, config.greedy, return_aux=config.uses_features)
            else:
                out, m, nxt = _verify_step(target, state, proposal, key, config, w, jnp.minimum(limit, w))
            aux = None if out.aux_hidden is None else pad_rows(out.aux_hidden, k + 1)
            return out.cache, m, nxt, aux, pad_rows(proposal.tokens, k)
        return run

    def main_chain():
        if len(widths) == 1:
            return branch(widths[0])()
        return jax.lax.switch(verify_width_index(widths, limit, active), [branch(w) for w in widths])

    if proposal.branch is None:
        return main_chain()
    if not config.greedy:
        raise ValueError("a second draft chain is verified only in greedy rounds (sampling takes one chain per round)")
    second = proposal.branch
    main_width, second_width = widths[-1], second.tokens.shape[1]
    if second_width > k:
        raise ValueError(f"the second chain's width {second_width} exceeds K={k}")
    n = state.target_cache.lengths
    fits = tree.second_chain_fits(n, main_width, second_width, state.target_cache.capacity)
    second_limit = jnp.where(fits, jnp.minimum(state.draft_limit, second.num_drafts), 0)

    def both_chains():
        return _two_chain_step(target, state, proposal, config, main_width, jnp.minimum(limit, main_width),
                               second_limit)

    return jax.lax.cond(jnp.any(active & (second_limit > 0)), both_chains, main_chain)


def _two_chain_step(target: CausalLM, state: SpecState, proposal: Proposal, config: SpecConfig, main_width: int,
                    main_limit: Int[Array, " B"], second_limit: Int[Array, " B"]):
    """ONE target forward over [last_token | main chain | second chain] (`generate.tree`), greedy
    acceptance on each chain, the longer accepted prefix kept and only its K/V committed."""
    k = config.num_draft_tokens
    main = proposal.tokens[:, :main_width]
    second = proposal.branch.tokens
    second_width = second.shape[1]
    n = state.target_cache.lengths
    layout = tree.two_chain_layout(n, main_width, second_width)
    tokens = jnp.concatenate([state.last_token[:, None], main, second], axis=1)
    out = target(tokens, layout.positions, state.target_cache, return_aux=config.uses_features,
                 slots=layout.slots, skip=(layout.skip_lo, layout.skip_hi))
    m_main, next_main = sampling.accept_greedy(main, out.logits[:, :main_width + 1], main_limit)
    rows = tree.second_chain_rows(main_width, second_width)
    m_second, next_second = sampling.accept_greedy(second, out.logits[:, rows], second_limit)
    won = m_second > m_main  # ties keep the main chain, whose K/V needs no move
    m = jnp.where(won, m_second, m_main)
    nxt = jnp.where(won, next_second, next_main)
    cache = tree.move_second_chain(out.cache, n, main_width, second_width, jnp.where(won, m_second, 0))
    aux = None
    if out.aux_hidden is not None:
        aux = jnp.where(won[:, None, None], pad_rows(out.aux_hidden[:, rows], k + 1),
                        pad_rows(out.aux_hidden[:, :main_width + 1], k + 1))
    drafts = jnp.where(won[:, None], pad_rows(second, k), pad_rows(main, k))
    return cache, m, nxt, aux, drafts


def _plain_round(target: CausalLM, drafter: Proposer, state: SpecState, config: SpecConfig, key: jax.Array,
                 active: Bool[Array, " B"]):
    """A round of a head method that drafts nothing: one 1-row target step, no drafter forward.

    The new row (the feature of position n_b with the token after it) joins the pending rows
    instead of going to the drafter; only when a sequence's pending buffer (K+1 rows) is full
    are the rows written into the drafter's cache in one pass (`Proposer.prefill`), so plain
    rounds cost a decode step plus one small drafter pass every few rounds, and the next
    speculative round drafts from exactly the rows it would have had.
    """
    w = config.num_draft_tokens + 1
    out, m, nxt = _plain_step(target, state, key, config.greedy, return_aux=config.uses_features)
    count = state.num_pending
    flush = jnp.any(active & (count >= w))

    def write_pending(_):
        base = state.target_cache.lengths - count  # rows past `count` land above it: dead, overwritten later
        positions = base[:, None] + jnp.arange(w)[None, :]
        cache = drafter.prefill(state.drafter_cache, state.pending_tokens, state.pending_feats, positions)
        return cache, jnp.zeros_like(count)

    dcache, kept = jax.lax.cond(flush, write_pending, lambda _: (state.drafter_cache, count), None)
    kept = jnp.where(active, kept, count)
    col = jnp.where(active, kept, w)  # where the new row goes (w: dropped)
    b = jnp.arange(count.shape[0])
    pend_tok = state.pending_tokens.at[b, col].set(nxt, mode="drop")
    # plain_rounds is for the head methods, which always read features
    feat = drafter.project(out.aux_hidden[:, 0]).astype(state.pending_feats.dtype)
    pend_feat = state.pending_feats.at[b, col].set(feat, mode="drop")
    emitted = pad_rows(nxt[:, None], w)
    return out.cache, dcache, m, nxt, emitted, pend_tok, pend_feat, jnp.where(active, kept + 1, count)


def spec_round(target: CausalLM, drafter: Proposer | None, state: SpecState, config: SpecConfig) -> SpecState:
    """One speculative round over the whole batch (finished sequences are frozen)."""
    active = ~state.done
    # Per-sequence keys folded with the sequence's own position: a request's samples depend
    # only on its seed and its text, not on when it joined the batch, who else is in it, or
    # whether this round speculates (`_plain_step` draws as a verify that accepts no draft).
    n = state.target_cache.lengths
    key = jax.vmap(jax.random.fold_in)(state.key, n)
    k_draft, k_verify = sampling.split_keys(key, 2)
    k = config.num_draft_tokens

    if not config.uses_drafter:
        out, m, nxt = _plain_step(target, state, k_verify, config.greedy)
        tcache = out.cache
        emitted = nxt[:, None]
        dcache, pend_tok, pend_feat, num_pending = (state.drafter_cache, state.pending_tokens, state.pending_feats,
                                                    state.num_pending)
    else:
        def speculative():
            settings = draft_settings(config, state, k_draft, target.config.vocab_size)
            proposal = drafter.propose(state.drafter_cache, pending_rows(state), settings)
            tcache, m, nxt, aux, drafts = _target_step(target, state, proposal, k_verify, config, active)
            rows = jnp.arange(k + 1)[None, :]
            emitted = jnp.where(rows == m[:, None], nxt[:, None], pad_rows(drafts, k + 1))
            pend_tok = _select(active, emitted, state.pending_tokens)
            pend_feat = None
            if config.uses_features:
                pend_feat = _select(active, drafter.project(aux), state.pending_feats)
            num_pending = jnp.where(active, m + 1, state.num_pending)
            return tcache, proposal.cache, m, nxt, emitted, pend_tok, pend_feat, num_pending

        if config.plain_rounds:
            need = jnp.max(jnp.where(active, state.draft_limit, 0))
            branches = jax.lax.cond(need > 0, speculative, lambda: _plain_round(target, drafter, state, config,
                                                                                 k_verify, active))
        else:
            branches = speculative()
        tcache, dcache, m, nxt, emitted, pend_tok, pend_feat, num_pending = branches

    num_new = m + 1
    output, out_len, done, hit_eos = _commit(state, emitted, num_new, k + 1)
    new_len = jnp.where(active, n + num_new, n)
    hist = state.accepted_per_pos
    if k:
        hist = hist + (active[:, None] & (jnp.arange(k)[None, :] < m[:, None])).astype(jnp.int32)
    return state._replace(
        target_cache=tcache.with_lengths(new_len),
        drafter_cache=dcache,
        last_token=jnp.where(active, nxt, state.last_token),
        pending_tokens=pend_tok,
        pending_feats=pend_feat,
        num_pending=num_pending,
        output=output,
        out_len=out_len,
        done=done,
        hit_eos=hit_eos,
        rounds=state.rounds + active.astype(jnp.int32),
        accepted_per_pos=hist,
    )


# --------------------------------------------------------------------------- prefill


def _first_token(logits: Float[Array, "B 1 V"], sp: SamplingParams, key: jax.Array, greedy: bool) -> Int[Array, " B"]:
    if greedy:
        return sampling.greedy_token(logits[:, 0])
    probs = sampling.process_logits(logits, sp.temperature, sp.top_k, sp.top_p)
    return sampling.sample_from_probs(key, probs)[:, 0]


class PromptContext(NamedTuple):
    """The KV a prompt has written so far: target and drafter rows of the positions before
    the next chunk. A long prompt is prefilled chunk by chunk into one of these (the server
    interleaves the chunks with other sequences' rounds), and `prefill` ends it."""

    target_cache: KVCache
    drafter_cache: Any  # the drafter's cache pytree, or None


def empty_context(target: CausalLM, drafter: Proposer | None, batch_size: int, config: SpecConfig) -> PromptContext:
    dcache = drafter.init_cache(batch_size, config.capacity) if config.uses_drafter else None
    return PromptContext(target.init_cache(batch_size, config.capacity), dcache)


def _write_prompt(target: CausalLM, drafter: Proposer | None, context: PromptContext, tokens: Int[Array, "B T"],
                  following: Int[Array, " B"], start: Int[Array, " B"], config: SpecConfig,
                  logit_rows: Int[Array, " B"]):
    """Prompt tokens at positions start.. into both caches: (context, logits at `logit_rows`, features).

    Drafter row p pairs the feature of position p with token p + 1, so the chunk's last row
    takes `following`, the first token of the next chunk (a final chunk's last row is dead: the
    first round's pending row overwrites it).
    """
    t = tokens.shape[1]
    positions = start[:, None] + jnp.arange(t)[None, :]
    out = target(tokens, positions, context.target_cache, logit_rows=logit_rows[:, None],
                 return_aux=config.uses_features)
    feats, dcache = None, context.drafter_cache
    if config.uses_drafter:
        feats = drafter.project(out.aux_hidden) if config.uses_features else None  # [B, T, H]
        shifted = jnp.concatenate([tokens[:, 1:], following[:, None].astype(tokens.dtype)], axis=1)
        dcache = drafter.prefill(dcache, shifted, feats, positions)
    return PromptContext(out.cache.with_lengths(start + t), dcache), out.logits, feats


def prefill_chunk(
    target: CausalLM,
    drafter: Proposer | None,
    context: PromptContext,
    tokens: Int[Array, "B T"],
    following: Int[Array, " B"],
    start: Int[Array, " B"],
    config: SpecConfig,
) -> PromptContext:
    """A full chunk of a long prompt (positions start..start+T-1; `following` is the prompt
    token at start+T): KV written, nothing emitted. `prefill` runs the last chunk."""
    no_logits = jnp.zeros((tokens.shape[0],), jnp.int32)  # one row's logits, unused
    context, _, _ = _write_prompt(target, drafter, context, tokens, following, start, config, no_logits)
    return context


def prefill(
    target: CausalLM,
    drafter: Proposer | None,
    tokens: Int[Array, "B T"],
    prompt_lens: Int[Array, " B"],
    config: SpecConfig,
    *,
    max_new: Int[Array, " B"],
    sp: SamplingParams,
    eos_ids: Int[Array, " E"],
    key: jax.Array,
    draft_limit: Int[Array, " B"] | None = None,
    context: PromptContext | None = None,
    start: Int[Array, " B"] | None = None,
) -> SpecState:
    """Run the prompts (right-padded to a bucket) and emit the first token.

    `draft_limit` caps the drafts each sequence may accept per round (default K: all).
    `tokens` are the prompt from position `start` (default 0) on, `context` the KV of the
    positions before it (from `prefill_chunk`; default: none); `prompt_lens` are whole lengths.

    The drafter also consumes the prompt: rows (feature p, token p+1) for p < L-1 are
    written to its cache now, and the last one, paired with the first generated token,
    becomes the single pending row of the first round.
    """
    b, t = tokens.shape
    k = config.num_draft_tokens
    start = jnp.zeros((b,), jnp.int32) if start is None else start.astype(jnp.int32)
    if context is None:
        context = empty_context(target, drafter, b, config)
    last = prompt_lens - 1 - start  # the last prompt row, within this chunk
    context, logits, feats = _write_prompt(target, drafter, context, tokens, jnp.zeros((b,), jnp.int32), start,
                                           config, last)
    k_first, k_rest = sampling.split_keys(key, 2)  # key: one per sequence, [B]
    first = _first_token(logits, sp, k_first, config.greedy)
    pend_tok = jnp.zeros((b, k + 1), jnp.int32).at[:, 0].set(first)
    pend_feat = None
    if config.uses_features:
        last_feat = jnp.take_along_axis(feats, last[:, None, None], axis=1)  # [B, 1, H]
        pend_feat = jnp.zeros((b, k + 1, feats.shape[-1]), feats.dtype).at[:, :1].set(last_feat)
    state = SpecState(
        target_cache=context.target_cache.with_lengths(prompt_lens),
        drafter_cache=context.drafter_cache,
        last_token=first,
        pending_tokens=pend_tok,
        pending_feats=pend_feat,
        num_pending=jnp.ones((b,), jnp.int32),
        output=jnp.zeros((b, config.out_size), jnp.int32),
        out_len=jnp.zeros((b,), jnp.int32),
        max_new=max_new.astype(jnp.int32),
        done=jnp.zeros((b,), bool),
        hit_eos=jnp.zeros((b,), bool),
        rounds=jnp.zeros((b,), jnp.int32),
        accepted_per_pos=jnp.zeros((b, k), jnp.int32),
        sampling=sp,
        draft_limit=jnp.full((b,), k, jnp.int32) if draft_limit is None else jnp.minimum(draft_limit, k),
        eos_ids=eos_ids,
        key=k_rest,
    )
    output, out_len, done, hit_eos = _commit(state, first[:, None], jnp.ones((b,), jnp.int32), k + 1)
    return state._replace(output=output, out_len=out_len, done=done, hit_eos=hit_eos)


# --------------------------------------------------------------------------- slots (serving)

# SpecState fields that are shared by the whole batch rather than per sequence.
_SHARED_FIELDS = ("eos_ids",)


def _map_sequences(fn, state: SpecState, *others: SpecState) -> SpecState:
    """`fn` over every per-sequence array of `state` (and the matching arrays of `others`);
    the shared fields and absent (None) parts are kept from `state`."""
    fields = {}
    for name in SpecState._fields:
        old = getattr(state, name)
        if name in _SHARED_FIELDS or old is None:
            fields[name] = old
        else:
            fields[name] = jax.tree.map(fn, old, *(getattr(o, name) for o in others))
    return SpecState(**fields)


def insert_sequences(state: SpecState, new: SpecState, slots: Int[Array, " n"]) -> SpecState:
    """Write the n sequences of `new` (e.g. fresh from `prefill`) into batch rows `slots`.

    Every per-sequence array (both KV caches and their lengths, pending rows, output buffer,
    counters, sampling settings) is scattered at `slots`; a slot index >= the batch size is
    dropped, so padding rows of a bucketed prefill batch can point past the end. The shared
    field (the eos ids) is kept from `state`. `new` must have been
    built with the same cache capacity, output size and number of draft tokens.
    """
    slots = jnp.asarray(slots, jnp.int32)

    def put(big, small):
        return big.at[slots].set(small.astype(big.dtype), mode="drop")

    return _map_sequences(put, state, new)


def finish_sequences(state: SpecState, mask: Bool[Array, " B"]) -> SpecState:
    """Mark rows finished (frozen by `spec_round`): how a server frees or empties slots."""
    return state._replace(done=state.done | mask)


def take_sequences(state: SpecState, rows: Int[Array, " m"]) -> SpecState:
    """The batch made of rows `rows` of `state`, in that order (the shared fields kept).

    How a server compacts its live sequences into a smaller batch: every per-sequence array
    moves with its row (KV caches, pending rows, output, counters, sampling settings, PRNG
    key), so a sequence continues exactly as it would have in its old slot.
    """
    rows = jnp.asarray(rows, jnp.int32)
    return _map_sequences(lambda a: jnp.take(a, rows, axis=0), state)

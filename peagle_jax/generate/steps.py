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
server drives slot by slot.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from peagle_jax import sampling
from peagle_jax.cache import KVCache
from peagle_jax.drafters.eagle3 import Eagle3Drafter
from peagle_jax.drafters.reference import ReferenceDrafter
from peagle_jax.models.transformer import CausalLM

Method = Literal["none", "eagle3", "peagle"]
METHODS = ("none", "eagle3", "peagle")

#: XLA options for every program that runs these steps. Greedy speculative decoding is exact
#: only if a row gets bitwise the same logits in a 1-row decode step, a K+1-row verify and a
#: batch of B such blocks. XLA:CPU's YNN library fusions merge a dot with neighbouring
#: elementwise and reduce ops into one kernel whose rounding depends on the row count (rows of
#: 2- and 8-row SmolLM2 forwards differed in bf16); keeping them to single dots makes every
#: row's value the same (tests/test_row_invariance.py). It is an xla_cpu_ debug option, meant to
#: be inert elsewhere; that has not yet been checked on a GPU.
STEP_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
#: `jax.jit` with STEP_COMPILER_OPTIONS (use it for anything that calls prefill / spec_round).
step_jit = functools.partial(jax.jit, compiler_options=STEP_COMPILER_OPTIONS)


class SamplingParams(NamedTuple):
    """Per-sequence sampling settings (arrays, so changing them never recompiles)."""

    temperature: Float[Array, "B"]
    top_k: Int[Array, "B"]
    top_p: Float[Array, "B"]

    @classmethod
    def full(cls, batch: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
        return cls(
            jnp.full((batch,), temperature, jnp.float32),
            jnp.full((batch,), top_k, jnp.int32),
            jnp.full((batch,), top_p, jnp.float32),
        )


class SpecState(NamedTuple):
    """Everything a round needs, per sequence; a pytree carried by `lax.while_loop`."""

    target_cache: KVCache  # lengths = n_b
    drafter_cache: KVCache | None
    last_token: Int[Array, "B"]
    pending_tokens: Int[Array, "B W"]  # W = K + 1
    pending_feats: Float[Array, "B W H"] | None  # drafter-space features (after fc)
    num_pending: Int[Array, "B"]
    output: Int[Array, "B N"]  # generated tokens (N = output buffer size)
    out_len: Int[Array, "B"]
    max_new: Int[Array, "B"]  # per-sequence token budget (<= N)
    done: Bool[Array, "B"]
    hit_eos: Bool[Array, "B"]
    rounds: Int[Array, "B"]  # target forwards after prefill, while active
    accepted_per_pos: Int[Array, "B K"]  # rounds in which draft position i was accepted
    sampling: SamplingParams
    eos_ids: Int[Array, "E"]
    key: jax.Array  # one PRNG key per sequence, [B]
    round_idx: Int[Array, ""]


# --------------------------------------------------------------------------- drafting


class Pending(NamedTuple):
    """The rows the next draft step feeds to the drafter (see the module docstring)."""

    tokens: Int[Array, "B W"]
    feats: Float[Array, "B W H"]
    count: Int[Array, "B"]  # C valid rows per sequence
    base: Int[Array, "B"]  # position of row 0 (n_b - C)

    @classmethod
    def of(cls, state: SpecState) -> "Pending":
        n = state.target_cache.lengths
        return cls(state.pending_tokens, state.pending_feats, state.num_pending, n - state.num_pending)


class DraftSettings(NamedTuple):
    """What every draft step needs besides the drafter, its cache and the pending rows."""

    num_draft: int
    key: jax.Array
    sampling: SamplingParams
    greedy: bool
    vocab: int  # target vocabulary size (q is scattered to it when sampling)


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    pad = rows - x.shape[1]
    if pad <= 0:
        return x[:, :rows]
    widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, widths)


def _draft_tokens_from_logits(
    drafter: Eagle3Drafter, logits: Float[Array, "B K Vd"], key, sp: SamplingParams, greedy: bool, vocab: int
) -> tuple[Int[Array, "B K"], Float[Array, "B K V"] | None]:
    """Draft ids (target vocabulary) and, when sampling, q over the target vocabulary."""
    if greedy:
        return drafter.to_target_ids(jnp.argmax(logits, axis=-1).astype(jnp.int32)), None
    draft_ids, q_draft = sampling.draft_from_logits(key, logits, sp.temperature, sp.top_k, sp.top_p)
    target_ids = drafter.to_target_ids(draft_ids)
    # q over the target vocabulary: draft-vocab probabilities scattered to their target ids.
    vocab_ids = drafter.to_target_ids(jnp.arange(logits.shape[-1]))
    q_full = jnp.zeros(logits.shape[:2] + (vocab,), jnp.float32).at[..., vocab_ids].set(q_draft)
    return target_ids, q_full


def draft_parallel(
    drafter: Eagle3Drafter, cache: KVCache, pending: Pending, ds: DraftSettings
) -> tuple[Int[Array, "B K"], Float[Array, "B K V"] | None, KVCache]:
    """P-EAGLE: K drafts from ONE forward over [pending | K-1 mask slots]."""
    cfg = drafter.config
    k = ds.num_draft
    rows = pending.tokens.shape[1] + k - 1
    j = jnp.arange(rows)[None, :]
    c = pending.count[:, None]
    is_pending = j < c
    tokens = jnp.where(is_pending, _pad_rows(pending.tokens, rows), cfg.mask_token_id)
    mask_feat = drafter.mask_feature().astype(pending.feats.dtype)
    feats = jnp.where(is_pending[..., None], _pad_rows(pending.feats, rows), mask_feat)
    positions = pending.base[:, None] + j
    logit_rows = c - 1 + jnp.arange(k)[None, :]  # last pending row + K-1 mask rows
    out = drafter(tokens, feats, positions, cache, logit_rows=logit_rows)
    drafts, q = _draft_tokens_from_logits(drafter, out.logits, ds.key, ds.sampling, ds.greedy, ds.vocab)
    return drafts, q, out.cache


def draft_sequential(
    drafter: Eagle3Drafter, cache: KVCache, pending: Pending, ds: DraftSettings
) -> tuple[Int[Array, "B K"], Float[Array, "B K V"] | None, KVCache]:
    """EAGLE-3: one forward over the pending rows, then K-1 single-row forwards."""
    b, w = pending.tokens.shape
    c = pending.count[:, None]
    positions = pending.base[:, None] + jnp.arange(w)[None, :]
    keys = sampling.split_keys(ds.key, ds.num_draft)

    def sample(logits, key):
        return _draft_tokens_from_logits(drafter, logits, key, ds.sampling, ds.greedy, ds.vocab)

    out = drafter(pending.tokens, pending.feats, positions, cache, logit_rows=c - 1)
    tok, q = sample(out.logits, keys[0])
    hidden = jnp.take_along_axis(out.prenorm, (c - 1)[..., None], axis=1)  # [B, 1, H]
    last_pos = pending.base + pending.count - 1

    def step(carry, i):
        cache, tok, hidden = carry
        o = drafter(tok, hidden, (last_pos + i)[:, None], cache, logit_rows=jnp.zeros((b, 1), jnp.int32))
        nt, nq = sample(o.logits, keys[i])
        return (o.cache, nt, o.prenorm), (nt[:, 0], None if nq is None else nq[:, 0])

    cache = out.cache
    if ds.num_draft == 1:
        return tok, q, cache
    (cache, _, _), (toks, qs) = jax.lax.scan(step, (cache, tok, hidden), jnp.arange(1, ds.num_draft))
    drafts = jnp.concatenate([tok, toks.T], axis=1)
    probs = None if q is None else jnp.concatenate([q, jnp.moveaxis(qs, 0, 1)], axis=1)
    return drafts, probs, cache


# --------------------------------------------------------------------------- target steps


def verify_forward(
    target: CausalLM, cache: KVCache, last_token: Int[Array, "B"], drafts: Int[Array, "B K"], *, return_aux: bool
):
    """ONE target forward over [last_token, d_1..d_K] at positions n..n+K."""
    tokens = jnp.concatenate([last_token[:, None], drafts], axis=1)
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
    return target(tokens, positions, cache, return_aux=return_aux)


def _commit(
    state: SpecState,
    emitted: Int[Array, "B R"],
    num_new: Int[Array, "B"],
    capacity_limit: int,
) -> tuple[Int[Array, "B N"], Int[Array, "B"], Bool[Array, "B"], Bool[Array, "B"]]:
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


def spec_round(
    target: CausalLM,
    drafter: Eagle3Drafter | None,
    state: SpecState,
    *,
    method: Method,
    num_draft: int,
    greedy: bool,
) -> SpecState:
    """One speculative round over the whole batch (finished sequences are frozen)."""
    active = ~state.done
    # Per-sequence keys advanced by the sequence's own round count: a request's samples
    # depend only on its seed, not on when it joined the batch or who else is in it.
    key = jax.vmap(jax.random.fold_in)(state.key, state.rounds)
    k_draft, k_verify = sampling.split_keys(key, 2)
    sp = state.sampling
    vocab = target.config.vocab_size
    tcache = state.target_cache
    n = tcache.lengths

    if method == "none":
        out = verify_forward(target, tcache, state.last_token, jnp.zeros((n.shape[0], 0), jnp.int32), return_aux=False)
        if greedy:
            nxt = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
        else:
            probs = sampling.process_logits(out.logits, sp.temperature, sp.top_k, sp.top_p)
            nxt = sampling.sample_from_probs(k_verify, probs)[:, 0]
        m = jnp.zeros_like(n)
        emitted = nxt[:, None]
        dcache, pend_tok, pend_feat = state.drafter_cache, state.pending_tokens, state.pending_feats
    else:
        oracle = drafter if isinstance(drafter, ReferenceDrafter) else None
        head = oracle.head if oracle is not None else drafter
        if head is None:
            drafts, q, dcache = oracle.propose(state.out_len, num_draft), None, state.drafter_cache
        else:
            draft_fn = draft_parallel if method == "peagle" else draft_sequential
            drafts, q, dcache = draft_fn(head, state.drafter_cache, Pending.of(state),
                                         DraftSettings(num_draft, k_draft, sp, greedy, vocab))
            if oracle is not None:  # drafting cost of the real head, acceptance of the oracle
                drafts, q = oracle.overlay(drafts, state.out_len), None
        out = verify_forward(target, tcache, state.last_token, drafts, return_aux=True)
        if greedy:
            m, nxt = sampling.accept_greedy(drafts, out.logits)
        else:
            m, nxt = sampling.verify(k_verify, drafts, q, out.logits, sp.temperature, sp.top_k, sp.top_p)
        rows = jnp.arange(num_draft + 1)[None, :]
        emitted = jnp.where(rows == m[:, None], nxt[:, None], _pad_rows(drafts, num_draft + 1))
        pend_tok = _select(active, emitted, state.pending_tokens)
        pend_feat = _select(active, drafter.project(out.aux_hidden), state.pending_feats)


    num_new = m + 1
    output, out_len, done, hit_eos = _commit(state, emitted, num_new, num_draft + 1)
    new_len = jnp.where(active, n + num_new, n)
    hist = state.accepted_per_pos
    if num_draft:
        hist = hist + (active[:, None] & (jnp.arange(num_draft)[None, :] < m[:, None])).astype(jnp.int32)
    return state._replace(
        target_cache=out.cache.with_lengths(new_len),
        drafter_cache=dcache,
        last_token=jnp.where(active, nxt, state.last_token),
        pending_tokens=pend_tok,
        pending_feats=pend_feat,
        num_pending=jnp.where(active, num_new, state.num_pending),
        output=output,
        out_len=out_len,
        done=done,
        hit_eos=hit_eos,
        rounds=state.rounds + active.astype(jnp.int32),
        accepted_per_pos=hist,
        round_idx=state.round_idx + 1,
    )


# --------------------------------------------------------------------------- prefill


def prefill(
    target: CausalLM,
    drafter: Eagle3Drafter | None,
    tokens: Int[Array, "B T"],
    prompt_lens: Int[Array, "B"],
    *,
    method: Method,
    num_draft: int,
    greedy: bool,
    capacity: int,
    out_size: int,
    max_new: Int[Array, "B"],
    sp: SamplingParams,
    eos_ids: Int[Array, "E"],
    key: jax.Array,
) -> SpecState:
    """Run the prompts (right-padded to a bucket) and emit the first token.

    The drafter also consumes the prompt: rows (feature p, token p+1) for p < L-1 are
    written to its cache now, and the last one, paired with the first generated token,
    becomes the single pending row of the first round.
    """
    b, t = tokens.shape
    tcache = target.init_cache(b, capacity)
    positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
    use_drafter = method != "none"
    out = target(tokens, positions, tcache, logit_rows=(prompt_lens - 1)[:, None], return_aux=use_drafter)
    k_first, k_rest = sampling.split_keys(key, 2)  # key: one per sequence, [B]
    if greedy:
        first = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
    else:
        probs = sampling.process_logits(out.logits, sp.temperature, sp.top_k, sp.top_p)
        first = sampling.sample_from_probs(k_first, probs)[:, 0]
    w = num_draft + 1
    pend_tok = jnp.zeros((b, w), jnp.int32).at[:, 0].set(first)
    dcache, pend_feat = None, None
    if use_drafter:
        feats = drafter.project(out.aux_hidden)  # [B, T, H]
        head = drafter.head if isinstance(drafter, ReferenceDrafter) else drafter
        if head is not None:
            # Drafter rows for p = 0..L-2: token p+1 with the feature of position p.
            shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
            dcache = head.init_cache(b, capacity)
            dcache = head(shifted, feats, positions, dcache, logit_rows=jnp.zeros((b, 1), jnp.int32)).cache
        last_feat = jnp.take_along_axis(feats, (prompt_lens - 1)[:, None, None], axis=1)  # [B, 1, H]
        pend_feat = jnp.zeros((b, w, feats.shape[-1]), feats.dtype).at[:, :1].set(last_feat)
    state = SpecState(
        target_cache=out.cache.with_lengths(prompt_lens),
        drafter_cache=dcache,
        last_token=first,
        pending_tokens=pend_tok,
        pending_feats=pend_feat,
        num_pending=jnp.ones((b,), jnp.int32),
        output=jnp.zeros((b, out_size), jnp.int32),
        out_len=jnp.zeros((b,), jnp.int32),
        max_new=max_new.astype(jnp.int32),
        done=jnp.zeros((b,), bool),
        hit_eos=jnp.zeros((b,), bool),
        rounds=jnp.zeros((b,), jnp.int32),
        accepted_per_pos=jnp.zeros((b, num_draft), jnp.int32),
        sampling=sp,
        eos_ids=eos_ids,
        key=k_rest,
        round_idx=jnp.zeros((), jnp.int32),
    )
    output, out_len, done, hit_eos = _commit(state, first[:, None], jnp.ones((b,), jnp.int32), num_draft + 1)
    return state._replace(output=output, out_len=out_len, done=done, hit_eos=hit_eos)


# --------------------------------------------------------------------------- slots (serving)

# SpecState fields that are shared by the whole batch rather than per sequence.
_SHARED_FIELDS = ("eos_ids", "round_idx")


def insert_sequences(state: SpecState, new: SpecState, slots: Int[Array, "n"]) -> SpecState:
    """Write the n sequences of `new` (e.g. fresh from `prefill`) into batch rows `slots`.

    Every per-sequence array (both KV caches and their lengths, pending rows, output buffer,
    counters, sampling settings) is scattered at `slots`; a slot index >= the batch size is
    dropped, so padding rows of a bucketed prefill batch can point past the end. The shared
    fields (eos ids, PRNG key, round counter) are kept from `state`. `new` must have been
    built with the same cache capacity, output size and number of draft tokens.
    """
    slots = jnp.asarray(slots, jnp.int32)

    def put(big, small):
        return big.at[slots].set(small.astype(big.dtype), mode="drop")

    fields = {}
    for name in SpecState._fields:
        old, fresh = getattr(state, name), getattr(new, name)
        if name in _SHARED_FIELDS or old is None:
            fields[name] = old
        else:
            fields[name] = jax.tree.map(put, old, fresh)
    return SpecState(**fields)


def finish_sequences(state: SpecState, mask: Bool[Array, "B"]) -> SpecState:
    """Mark rows finished (frozen by `spec_round`): how a server frees or empties slots."""
    return state._replace(done=state.done | mask)

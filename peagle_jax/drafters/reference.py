"""A drafter that replays a known continuation, right on a chosen set of positions.

Used to test exactness (a perfect oracle must reach acceptance length K+1; a drafter that is
wrong on a controlled fraction of positions must still give the target's exact output) and
by the synthetic-acceptance benchmark. It plugs into the same round as the learned heads,
with the same static shapes, so the verify/accept/commit path it exercises is the real one.

Two ways to choose the wrong positions:
  * `wrong_every`: a fixed arithmetic pattern over output positions (reproducible AL);
  * `acceptance`: a per-position acceptance curve to replay (e.g. a published one). Slot i
    of a round is right with probability acceptance[i] / acceptance[i-1] given that the slots
    before it were, drawn from a hash of (sequence, output position); every output position
    is drafted-and-checked at most once, so the rounds follow the curve in expectation.

With `head` (a real EAGLE-3 / P-EAGLE drafter, random weights are fine) the head runs in
every round exactly as it would in serving, and its drafts are then replaced by the oracle's:
the timing includes the drafting cost, the acceptance is the replayed one.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from peagle_jax.cache import KVCache
from peagle_jax.drafters.drafting import DraftSettings, Pending, Proposal


class ReferenceTokens(nnx.Variable):
    """Non-trainable table of expected output tokens (and the oracle's other settings)."""


def _hash_uniform(row: Int[Array, "..."], pos: Int[Array, "..."]) -> Float[Array, "..."]:
    """A uniform in [0, 1) from (row, pos): the murmur3 32-bit finaliser of a mixed key."""
    h = row.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) + pos.astype(jnp.uint32) * jnp.uint32(0x85EBCA77)
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) / float(1 << 24)


def conditional_acceptance(acceptance: Sequence[float], k: int) -> np.ndarray:
    """P(slot i right | slots < i right) from cumulative per-position acceptance (0 past its end)."""
    a = np.zeros(k, np.float64)
    n = min(k, len(acceptance))
    a[:n] = np.asarray(acceptance[:n], np.float64)
    if np.any(a[:n] < 0) or np.any(a[:n] > 1) or np.any(np.diff(a[:n]) > 1e-12):
        raise ValueError(f"acceptance must be non-increasing rates in [0, 1], got {list(acceptance)}")
    prev = np.concatenate([[1.0], a[:-1]])
    return np.where(prev > 0, a / np.maximum(prev, 1e-300), 0.0).astype(np.float32)


class ReferenceDrafter(nnx.Module):
    """Proposes `reference[b, out_len + i]` for draft slot i, corrupted where the schedule says.

    reference: [B, N] expected output tokens (e.g. the greedy output of the target alone).
    wrong_every: draft output position p is made wrong when (p * 7 + 3) % wrong_every == 0
      (0 = never); a deterministic pattern, so acceptance is reproducible.
    acceptance: cumulative per-position acceptance to replay instead (see the module doc);
      its length bounds K (slots past it are always wrong).
    head: optional real drafter whose forward passes run every round (drafting cost); the
      round then drafts with it (parallel or sequential, by the method) and overlays the
      oracle's tokens on its drafts.
    """

    def __init__(self, reference: np.ndarray, vocab_size: int, *, wrong_every: int = 0, pad: int = 64,
                 acceptance: Sequence[float] | None = None, max_draft: int = 16, head: nnx.Module | None = None):
        ref = np.asarray(reference, np.int32)
        ref = np.pad(ref, ((0, 0), (0, pad)))  # room for K slots past the end
        self.reference = ReferenceTokens(jnp.asarray(ref))
        self.vocab_size = vocab_size
        # Traced values, so oracles with different error patterns share one compilation.
        self.wrong_every = ReferenceTokens(jnp.asarray(wrong_every, jnp.int32))
        cond = conditional_acceptance(acceptance, max_draft) if acceptance is not None else np.ones(max_draft)
        self.use_schedule = ReferenceTokens(jnp.asarray(acceptance is not None))
        self.conditional = ReferenceTokens(jnp.asarray(cond, jnp.float32))
        self.head = head

    def set_schedule(self, *, wrong_every: int = 0, acceptance: Sequence[float] | None = None) -> None:
        """Switch the error pattern in place (no recompilation: the settings are traced)."""
        k = self.conditional[...].shape[0]
        cond = conditional_acceptance(acceptance, k) if acceptance is not None else np.ones(k)
        self.wrong_every.value = jnp.asarray(wrong_every, jnp.int32)
        self.use_schedule.value = jnp.asarray(acceptance is not None)
        self.conditional.value = jnp.asarray(cond, jnp.float32)

    uses_features = True  # drafts from the target's feature taps

    def project(self, aux: Float[Array, "B T A"]) -> Float[Array, "B T H"]:
        if self.head is not None:
            return self.head.project(aux)
        return aux[..., :1]  # keep the pending-feature plumbing cheap

    @property
    def feature_spec(self) -> jax.ShapeDtypeStruct:
        """Width and dtype of `project`'s output (one float32 column without a head)."""
        return jax.ShapeDtypeStruct((1,), jnp.float32) if self.head is None else self.head.feature_spec

    @property
    def can_draft_parallel(self) -> bool:
        return self.head is None or self.head.can_draft_parallel

    def init_cache(self, batch_size: int, capacity: int) -> KVCache | None:
        return None if self.head is None else self.head.init_cache(batch_size, capacity)

    def prefill(self, cache: KVCache | None, tokens: Int[Array, "B T"], feats: Float[Array, "B T H"],
                positions: Int[Array, "B T"]) -> KVCache | None:
        """The head's prompt cache (its cost is part of what a head-driven oracle measures)."""
        return None if self.head is None else self.head.prefill(cache, tokens, feats, positions)

    def propose(self, cache: KVCache | None, pending: Pending, settings: DraftSettings) -> Proposal:
        """The oracle's drafts (q None: a point mass), after the head's own drafting if any."""
        if self.head is None:
            return Proposal(self.tokens_at(settings.out_len, settings.num_draft_tokens), None, cache)
        drafted = self.head.propose(cache, pending, settings)
        return Proposal(self.overlay(drafted.tokens, settings.out_len), None, drafted.cache)

    def tokens_at(self, out_len: Int[Array, " B"], num_draft: int) -> Int[Array, "B K"]:
        """Reference tokens for output positions out_len.. out_len+K-1, wrong where scheduled."""
        pos = out_len[:, None] + jnp.arange(num_draft)[None, :]
        ref = self.reference[...]
        pos = jnp.minimum(pos, ref.shape[1] - 1)
        tokens = jnp.take_along_axis(ref, pos, axis=1)
        every = self.wrong_every[...]
        wrong = (every > 0) & ((pos * 7 + 3) % jnp.maximum(every, 1) == 0)
        cond = self.conditional[...]
        if num_draft > cond.shape[0]:
            raise ValueError(f"num_draft {num_draft} exceeds the oracle's max_draft {cond.shape[0]}")
        rows = jnp.broadcast_to(jnp.arange(pos.shape[0])[:, None], pos.shape)
        replay_wrong = _hash_uniform(rows, pos) >= cond[None, :num_draft]
        wrong = jnp.where(self.use_schedule[...], replay_wrong, wrong)
        return jnp.where(wrong, (tokens + 1) % self.vocab_size, tokens)

    def overlay(self, drafted: Int[Array, "B K"], out_len: Int[Array, " B"]) -> Int[Array, "B K"]:
        """The oracle's tokens, kept data-dependent on the head's drafts so its compute stays."""
        oracle = self.tokens_at(out_len, drafted.shape[1])
        return jnp.where(drafted < 0, drafted, oracle)  # ids are never negative

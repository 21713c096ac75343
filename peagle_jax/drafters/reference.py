"""A drafter that replays a known continuation, right on a chosen set of positions.

Used to test exactness (a perfect oracle must reach acceptance length K+1; a drafter that is
wrong on a controlled fraction of positions must still give the target's exact output) and
by the synthetic-acceptance benchmark mode. It plugs into the same round as the learned
heads, with the same static shapes, so the verify/accept/commit path it exercises is the
real one.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int


class ReferenceTokens(nnx.Variable):
    """Non-trainable table of expected output tokens."""


class ReferenceDrafter(nnx.Module):
    """Proposes `reference[b, out_len + i]` for draft slot i, corrupted where `wrong` says.

    reference: [B, N] expected output tokens (e.g. the greedy output of the target alone).
    wrong_every: draft output position p is made wrong when (p * 7 + 3) % wrong_every == 0
      (0 = never); a deterministic pattern, so acceptance is reproducible.
    Draft-side features are unused, so `project` returns the taps unchanged.
    """

    def __init__(self, reference: np.ndarray, vocab_size: int, *, wrong_every: int = 0, pad: int = 64):
        ref = np.asarray(reference, np.int32)
        ref = np.pad(ref, ((0, 0), (0, pad)))  # room for K slots past the end
        self.reference = ReferenceTokens(jnp.asarray(ref))
        self.vocab_size = vocab_size
        # A traced value, so oracles with different error patterns share one compilation.
        self.wrong_every = ReferenceTokens(jnp.asarray(wrong_every, jnp.int32))

    def project(self, aux):
        return aux[..., :1]  # keep the pending-feature plumbing cheap

    def propose(self, out_len: Int[Array, "B"], num_draft: int) -> Int[Array, "B K"]:
        pos = out_len[:, None] + jnp.arange(num_draft)[None, :]
        ref = self.reference[...]
        pos = jnp.minimum(pos, ref.shape[1] - 1)
        tokens = jnp.take_along_axis(ref, pos, axis=1)
        every = self.wrong_every[...]
        wrong = (every > 0) & ((pos * 7 + 3) % jnp.maximum(every, 1) == 0)
        return jnp.where(wrong, (tokens + 1) % self.vocab_size, tokens)

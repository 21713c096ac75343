"""The serving engine's jitted programs: those bound to the models (`Programs`: empty prompt
context, prompt chunk, final prefill, round) and the moves of batch rows (`insert_jit`,
`finish_jit`, `take_jit`). `serve.runner.Runner` runs them on the batch state.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from peagle_jax.generate import steps
from peagle_jax.generate.speculative import merge_models
from peagle_jax.generate.steps import SpecConfig, step_jit

__all__ = ["Programs", "finish_jit", "insert_jit", "keys_from_seeds", "take_jit"]


@jax.jit
def keys_from_seeds(seeds):
    return jax.vmap(jax.random.key)(seeds)


class Programs:
    """The engine's jitted programs (empty prompt context, prompt chunk, final prefill, round),
    bound to its models once.

    With the models' graph definitions as static arguments, every call hashed them and
    flattened the weights' `nnx.State`: about 16 ms per round on 2 CPU cores, a third of a
    round of the default model. Bound here, a call takes the weights as flat lists of arrays
    and one static flag (greedy or sampled round).
    """

    def __init__(self, target, drafter, spec: SpecConfig):
        target_def, target_state = nnx.split(target)
        drafter_def, drafter_state = nnx.split(drafter) if drafter is not None else (None, None)
        self.weights = (jax.tree.leaves(target_state), jax.tree.leaves(drafter_state))
        target_tree, drafter_tree = jax.tree.structure(target_state), jax.tree.structure(drafter_state)

        def models(weights):
            drafter = None if drafter_def is None else jax.tree.unflatten(drafter_tree, weights[1])
            return merge_models(target_def, jax.tree.unflatten(target_tree, weights[0]), drafter_def, drafter)

        def context_fn(weights, batch_size):
            target, drafter = models(weights)
            return steps.empty_context(target, drafter, batch_size, spec)

        def chunk_fn(weights, context, tokens, following, start):
            target, drafter = models(weights)
            return steps.prefill_chunk(target, drafter, context, tokens, following, start, spec)

        def prefill_fn(weights, context, tokens, start, lens, max_new, sp, eos_ids, key, draft_limit, greedy):
            target, drafter = models(weights)
            return steps.prefill(target, drafter, tokens, lens, dataclasses.replace(spec, greedy=greedy),
                                 max_new=max_new, sp=sp, eos_ids=eos_ids, key=key, draft_limit=draft_limit,
                                 context=context, start=start)

        def round_fn(weights, state, speculate, greedy):
            """One round; also returns what the host needs: the new tokens of each row and stats.
            `speculate` False runs it with every draft limit 0 (a plain round, see SpecConfig)."""
            target, drafter = models(weights)
            prev_len, prev_hist = state.out_len, state.accepted_per_pos
            limit = state.draft_limit
            new = steps.spec_round(target, drafter, state._replace(draft_limit=jnp.where(speculate, limit, 0)),
                                   dataclasses.replace(spec, greedy=greedy))
            new = new._replace(draft_limit=limit)
            idx = prev_len[:, None] + jnp.arange(spec.num_draft_tokens + 1)[None, :]
            toks = jnp.take_along_axis(new.output, jnp.minimum(idx, new.output.shape[1] - 1), axis=1)
            accepted = jnp.sum(new.accepted_per_pos - prev_hist, axis=1)
            return new, (toks, new.out_len - prev_len, new.done, new.hit_eos, accepted)

        self.context = step_jit(context_fn, static_argnames=("batch_size",))
        self.chunk = step_jit(chunk_fn, donate_argnames=("context",))
        self.prefill = step_jit(prefill_fn, static_argnames=("greedy",), donate_argnames=("context",))
        self.round = step_jit(round_fn, static_argnames=("greedy",), donate_argnames=("state",))


@functools.partial(jax.jit, donate_argnames=("state",))
def insert_jit(state, new, slots):
    return steps.insert_sequences(state, new, slots)


@functools.partial(jax.jit, donate_argnames=("state",))
def finish_jit(state, mask):
    return steps.finish_sequences(state, mask)


@jax.jit  # no donation: the result has another shape, so the old buffers could not be reused
def take_jit(state, rows):
    return steps.take_sequences(state, rows)

"""`speculative_generate`: prefill plus a `lax.while_loop` of speculative rounds, one jit."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from peagle_jax import kernels
from peagle_jax.generate.steps import SpecConfig, prefill, spec_round, step_jit
from peagle_jax.sampling import SamplingParams


@dataclasses.dataclass
class GenerationResult:
    """Tokens and statistics of one `speculative_generate` call (host numpy arrays)."""

    tokens: list[list[int]]  # generated tokens per prompt (EOS included when hit)
    lengths: np.ndarray  # [B]
    finish_reasons: list[str]  # "stop" (EOS) or "length"
    rounds: np.ndarray  # [B] target forwards after prefill
    accepted_per_position: np.ndarray  # [K] rounds in which draft position i was accepted
    num_draft_tokens: int
    accepted_per_sequence: np.ndarray | None = None  # [B, K] the same counts per sequence

    @property
    def total_rounds(self) -> int:
        return int(self.rounds.sum())

    @property
    def acceptance_rate_per_position(self) -> np.ndarray:
        """Fraction of rounds in which draft position i (1-based i+1) was accepted."""
        return self.accepted_per_position / max(self.total_rounds, 1)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target forward: (accepted drafts + 1) averaged over rounds."""
        r = self.total_rounds
        return float((r + self.accepted_per_position.sum()) / r) if r else 0.0


def prompt_bucket(length: int, minimum: int = 16) -> int:
    """The padded prompt length: the smallest of minimum * {1, 1.5, 2, 3, 4, 6, ...} >= length.

    Buckets bound recompiles to two per doubling of the prompt length. The half steps between
    powers of two cap the padding at a third of the bucket instead of a half: prefill
    computes every padded row, and at batch 1 on a CPU a 180-token prompt prefilled at 256
    rows spent ~30% of its prefill (~10 decode steps) on padding.
    """
    if length < 1 or minimum < 1:
        raise ValueError(f"prompt length and bucket minimum must be positive, got {length} and {minimum}")
    power = minimum
    while True:
        for bucket in (power, power * 3 // 2):
            if bucket >= length:
                return bucket
        power *= 2


def budget_bucket(max_new_tokens: int, room: int) -> int:
    """The output buffer a generation compiles for: `max_new_tokens` rounded up the way prompts
    are (`prompt_bucket`), and at most `room` (what the context leaves after the prompt bucket).

    The budget itself is a traced argument, so calls whose budgets share a bucket share one
    program: a client that asks for 100 tokens and then 120 compiles once, as on vLLM.
    """
    return max(min(prompt_bucket(max_new_tokens), room), max_new_tokens)


def cache_capacity(prompt_bucket_len: int, max_new_tokens: int, num_draft: int) -> int:
    """KV rows a generation needs (prompt bucket + budget + a round's overshoot), rounded up to 64."""
    return -(-(prompt_bucket_len + max_new_tokens + 2 * num_draft + 2) // 64) * 64


def merge_models(target_def, target_state, drafter_def, drafter_state):
    """Rebuild (target, drafter) inside a jitted function from split graph definitions and state."""
    target = nnx.merge(target_def, target_state)
    drafter = nnx.merge(drafter_def, drafter_state) if drafter_def is not None else None
    return target, drafter


@functools.partial(step_jit, static_argnames=("target_def", "drafter_def", "config"))
def _generate_jit(target_state, drafter_state, tokens, prompt_lens, max_new, sp, eos_ids, key,
                  *, target_def, drafter_def, config: SpecConfig):
    target, drafter = merge_models(target_def, target_state, drafter_def, drafter_state)
    state = prefill(target, drafter, tokens, prompt_lens, config, max_new=max_new, sp=sp, eos_ids=eos_ids, key=key)
    body = functools.partial(spec_round, target, drafter, config=config)
    state = jax.lax.while_loop(lambda s: jnp.any(~s.done), body, state)
    return state.output, state.out_len, state.hit_eos, state.rounds, state.accepted_per_pos


def default_draft_cutoff() -> float:
    """A head's confidence cutoff when the caller gives none (`drafters.drafting.confident_drafts`).

    On CPU a verify row costs about a tenth of a decode step and a width-0 round (a plain step
    plus the draft pass) 1.15, so drafts the head gives less than a 10% chance are cheaper left
    unverified: with the shipped P-EAGLE head, 0.05-0.1 gave the best simulated and measured
    speed on HumanEval and MT-Bench (docs/usage.md, "Draft cutoff"). On an accelerator,
    where a few more rows cost almost nothing, 0: verify every draft.
    """
    return 0.1 if jax.default_backend() == "cpu" else 0.0


def default_num_draft_tokens() -> int:
    """K when the caller gives none: the fastest measured with the shipped heads.

    What K pays is what a verify row costs. With AMX tiles each row costs about a tenth of a
    decode step and the heads' third draft is accepted in a few percent of rounds: offline
    HumanEval (164 prompts, batch 1) ran P-EAGLE at 1.14x plain decoding with K=2 and 1.09x with
    K=3, and with the default draft cutoff (0.1) 1.17x against 1.15x (docs/usage.md, the K left
    out). Without AMX a row costs far more (on the AVX2 loops a row past the second about 85% of
    a decode step's matmuls, docs/cpu-kernels.md), and K=1 was the fastest on HumanEval and
    MT-Bench both on an AVX2-only EPYC (results/offline_qwen05_g4) and on an AVX512-BF16 one
    (results/offline_smollm2_ks_zen4), so K=1 there. On an accelerator, where a few more rows
    cost almost nothing, K=3: the heads accept next to nothing past their third draft.
    """
    if jax.default_backend() != "cpu":
        return 3
    return 2 if kernels.cpu.instruction_set() == "amx" else 1


def speculative_generate(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    method: str = "peagle",
    num_draft_tokens: int | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_ids: Sequence[int] = (),
    seed: int = 0,
    min_bucket: int = 16,
) -> GenerationResult:
    """Generate from B prompts with speculative decoding, entirely on device.

    method: "peagle" (K drafts from one drafter forward), "eagle3" (K sequential drafter
      forwards), "ngram" (prompt lookup; `drafter` None means `NgramProposer()`) or "none"
      (plain decoding; `drafter` may be None).
    num_draft_tokens: K (None: `default_num_draft_tokens()`, the fastest measured here).
      A head verifies fewer where its `draft_cutoff` says so (`drafters.drafting.confident_drafts`).
    Greedy output (temperature 0) is token-identical to plain greedy decoding of `target`;
    sampled output follows the target's processed distribution exactly.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if method == "ngram" and drafter is None:
        from peagle_jax.drafters.ngram import NgramProposer

        drafter = NgramProposer()
    b = len(prompts)
    t = prompt_bucket(max(len(p) for p in prompts), min_bucket)
    if num_draft_tokens is None:
        num_draft_tokens = default_num_draft_tokens()
    k = num_draft_tokens if method != "none" else 0
    max_ctx = target.config.max_position_embeddings
    if t + max_new_tokens > max_ctx:
        raise ValueError(f"prompt bucket {t} + max_new_tokens {max_new_tokens} exceeds the model's context {max_ctx}")
    budget = budget_bucket(max_new_tokens, max_ctx - t)
    config = SpecConfig(method, k, temperature == 0.0, cache_capacity(t, budget, k), budget)
    config.check_drafter(drafter)
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lens = np.array([len(p) for p in prompts], np.int32)
    target_def, target_state = nnx.split(target)
    if config.uses_drafter:
        drafter_def, drafter_state = nnx.split(drafter)
    else:
        drafter_def, drafter_state = None, None
    eos = np.array(list(eos_token_ids) or [-1], np.int32)
    sp = SamplingParams.full(b, temperature, top_k, top_p)
    output, out_len, hit_eos, rounds, hist = _generate_jit(
        target_state, drafter_state, jnp.asarray(tokens), jnp.asarray(lens),
        jnp.full((b,), max_new_tokens, jnp.int32), sp, jnp.asarray(eos), jax.random.split(jax.random.key(seed), b),
        target_def=target_def, drafter_def=drafter_def, config=config,
    )
    output, out_len, hit_eos = np.asarray(output), np.asarray(out_len), np.asarray(hit_eos)
    return GenerationResult(
        tokens=[output[i, : out_len[i]].tolist() for i in range(b)],
        lengths=out_len,
        finish_reasons=["stop" if e else "length" for e in hit_eos],
        rounds=np.asarray(rounds),
        accepted_per_position=np.asarray(hist).sum(axis=0),
        num_draft_tokens=k,
        accepted_per_sequence=np.asarray(hist),
    )

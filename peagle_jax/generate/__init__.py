"""Prefill / draft / verify / accept steps and `speculative_generate()`."""

from peagle_jax.generate.speculative import (
    GenerationResult,
    default_draft_cutoff,
    default_num_draft_tokens,
    prompt_bucket,
    speculative_generate,
)
from peagle_jax.generate.steps import METHODS, SpecConfig, SpecState, prefill, spec_round
from peagle_jax.sampling import SamplingParams

__all__ = [
    "GenerationResult", "METHODS", "SamplingParams", "SpecConfig", "SpecState", "prefill", "prompt_bucket",
    "default_draft_cutoff", "default_num_draft_tokens", "spec_round", "speculative_generate",
]

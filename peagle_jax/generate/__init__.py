"""Prefill / draft / verify / accept steps and `speculative_generate()`."""

from peagle_jax.generate.speculative import GenerationResult, prompt_bucket, speculative_generate
from peagle_jax.generate.steps import METHODS, SamplingParams, SpecState, prefill, spec_round

__all__ = [
    "GenerationResult", "METHODS", "SamplingParams", "SpecState", "prefill", "prompt_bucket",
    "spec_round", "speculative_generate",
]

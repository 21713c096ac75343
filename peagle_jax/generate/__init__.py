"""Prefill / draft / verify / accept steps and `speculative_generate()`."""

from peagle_jax.generate.speculative import GenerationResult, prompt_bucket, speculative_generate
from peagle_jax.generate.steps import METHODS, SpecConfig, SpecState, prefill, spec_round
from peagle_jax.sampling import SamplingParams

__all__ = [
    "GenerationResult", "METHODS", "SamplingParams", "SpecConfig", "SpecState", "prefill", "prompt_bucket",
    "spec_round", "speculative_generate",
]

"""Target language models as Flax NNX modules."""

from peagle_jax.models.config import ModelConfig
from peagle_jax.models.transformer import CausalLM, ForwardOutput, create_model

__all__ = ["ModelConfig", "CausalLM", "ForwardOutput", "create_model"]

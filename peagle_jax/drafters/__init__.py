"""Draft heads: EAGLE-3 with the P-EAGLE parallel-drafting mode."""

from peagle_jax.drafters.config import DrafterConfig
from peagle_jax.drafters.eagle3 import DrafterOutput, Eagle3Drafter, create_drafter

__all__ = ["DrafterConfig", "DrafterOutput", "Eagle3Drafter", "create_drafter"]

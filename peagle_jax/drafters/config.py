"""Draft head configuration (EAGLE-3 architecture, optional P-EAGLE parallel drafting)."""

from __future__ import annotations

import dataclasses
from typing import Any

from peagle_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # target vocabulary (embedding rows)
    draft_vocab_size: int  # lm_head rows; d2t maps them to target ids
    target_hidden_size: int
    num_aux_layers: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    norm_before_residual: bool = False
    # P-EAGLE: placeholder token whose embedding fills slots 1..K-1 (None = EAGLE-3 only).
    mask_token_id: int | None = None
    parallel_drafting: bool = False
    num_depths: int = 8  # K the head was trained for (informational; K is chosen at run time)
    aux_layer_ids: tuple[int, ...] | None = None
    dtype: str = "float32"

    @property
    def fc_in_features(self) -> int:
        return self.num_aux_layers * self.target_hidden_size

    def replace(self, **changes: Any) -> DrafterConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        *,
        num_layers: int = 1,
        parallel_drafting: bool = False,
        mask_token_id: int | None = None,
        draft_vocab_size: int | None = None,
        num_depths: int = 8,
        **overrides: Any,
    ) -> DrafterConfig:
        """The drafter shape used by every released head: the target's decoder layer shape."""
        inter = target.intermediate_size or 3 * target.hidden_size  # MoE targets: 3H (speculators)
        fields = dict(
            hidden_size=target.hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            intermediate_size=inter,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            target_hidden_size=target.hidden_size,
            num_aux_layers=len(target.eagle_aux_layer_ids),
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            parallel_drafting=parallel_drafting,
            mask_token_id=mask_token_id,
            num_depths=num_depths,
            aux_layer_ids=target.eagle_aux_layer_ids,
            dtype=target.dtype,
        )
        fields.update(overrides)
        cfg = cls(**fields)
        if cfg.parallel_drafting and cfg.mask_token_id is None:
            raise ValueError("parallel drafting (P-EAGLE) needs a mask_token_id")
        return cfg

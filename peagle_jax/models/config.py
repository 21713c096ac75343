"""Target model configuration, built from an HF ``config.json`` or GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

Architecture = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss"]

# HF `model_type` / `architectures[0]` -> our architecture family.
_MODEL_TYPES: dict[str, Architecture] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "gpt_oss": "gpt_oss",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs; hashable so it can be a static jit argument."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # (("rope_type", "llama3"), ("factor", 8.0), ...) as a sorted tuple so the config stays hashable.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: q/k/v carry biases
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k before rotary
    # MoE (qwen3_moe); num_experts == 0 means dense MLP everywhere.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # gpt_oss: the router has a bias and softmaxes its top-k logits (qwen3_moe: softmax, then
    # top-k); experts carry biases and gate with a clamped SwiGLU, (up + 1) * g * sigmoid(alpha g).
    moe_router: Literal["softmax_topk", "topk_softmax"] = "softmax_topk"
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # gpt_oss: a learned per-head logit that joins every softmax (the attention sink), and
    # layers that see only the last `sliding_window` positions (`sliding_layers`).
    attention_sinks: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # EAGLE-3 feature taps: residual stream entering these layers.
    aux_layer_ids: tuple[int, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    @property
    def eagle_aux_layer_ids(self) -> tuple[int, ...]:
        """Default taps (2, L//2, L-3), as vLLM's `get_eagle3_default_aux_hidden_state_layers`."""
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        n = self.num_hidden_layers
        return (min(2, n - 1), n // 2, max(n - 3, 0))

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def layer_window(self, layer_idx: int) -> int | None:
        """How many positions layer `layer_idx` attends back over (None: all)."""
        return self.sliding_window if layer_idx in self.sliding_layers else None

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], **overrides: Any) -> ModelConfig:
        """Build from a parsed HF ``config.json``; unsupported model types raise ValueError."""
        model_type = cfg.get("model_type")
        if model_type not in _MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {sorted(_MODEL_TYPES)}"
            )
        arch = _MODEL_TYPES[model_type]
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
                   if k not in cfg]
        if missing:
            raise ValueError(f"config.json is missing required keys: {missing}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        if cfg.get("use_sliding_window") and arch != "gpt_oss":
            raise ValueError("use_sliding_window=true (sliding-window attention) is only supported for gpt_oss")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if rope_scaling:
            rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype == "default":
                rope_scaling = None
            elif rtype not in ("llama3", "linear", "yarn"):
                raise ValueError(f"unsupported rope_scaling type {rtype!r}; supported: llama3, linear, yarn")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        aux = cfg.get("eagle_aux_hidden_state_layer_ids")
        oss = arch == "gpt_oss"
        layer_types = cfg.get("layer_types") or (
            ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg["num_hidden_layers"])]
            if oss else [])
        unknown_types = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if unknown_types:
            raise ValueError(f"unsupported layer_types {unknown_types}; supported: sliding_attention, full_attention")
        sliding = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
        if sliding and not cfg.get("sliding_window"):
            raise ValueError("layer_types names sliding_attention layers but sliding_window is not set")
        fields = dict(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 4 * cfg["hidden_size"]),
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # qwen2 always has q/k/v biases (its config has no switch for them)
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            # transformers 5 writes `num_local_experts` (`num_experts` is an attribute alias)
            num_experts=(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            if arch in ("qwen3_moe", "gpt_oss") else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            # gpt_oss's experts are as wide as its `intermediate_size`; it has no dense MLP
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0) or (
                cfg.get("intermediate_size", 0) if oss else 0),
            moe_router="topk_softmax" if oss else "softmax_topk",
            moe_bias=oss,
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)) if oss else None,
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            attention_sinks=oss,
            sliding_window=cfg.get("sliding_window") if sliding else None,
            sliding_layers=sliding,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers", ()) or ()),
            aux_layer_ids=tuple(aux) if aux else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_json_file(cls, path: str | Path, **overrides: Any) -> ModelConfig:
        return cls.from_hf_dict(json.loads(Path(path).read_text()), **overrides)

"""HF safetensors checkpoints (config.json + one file or a sharded index) -> CausalLM.

HF names map to ours by a declarative table of regexes; torch's Linear stores [out, in] and
we store [in, out], so every projection is transposed. Routed experts are accepted both in
the hub layout (`mlp.experts.{e}.gate_proj.weight`) and in transformers 5's fused layout
(`mlp.experts.gate_up_proj` [E, 2I, D]); GPT-OSS's own layouts are `checkpoints.gpt_oss`'s.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open

from peagle_jax.checkpoints.gpt_oss import convert_gpt_oss_tensors
from peagle_jax.checkpoints.params import CheckpointError, assign_params
from peagle_jax.models.config import ModelConfig
from peagle_jax.models.transformer import CausalLM, abstract_model

# (HF regex, our path template, transpose?)
_KEY_MAP: list[tuple[str, str, bool]] = [
    (r"model\.embed_tokens\.weight", "embed_tokens", False),
    (r"lm_head\.weight", "lm_head", True),
    (r"model\.norm\.weight", "norm.weight", False),
    (r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight", r"layers.\1.\2.weight", False),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight", r"layers.\1.self_attn.\2_proj.kernel", True),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.bias", r"layers.\1.self_attn.\2_proj.bias", False),
    (r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.weight", r"layers.\1.self_attn.\2_norm.weight", False),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.kernel", True),
    (r"model\.layers\.(\d+)\.mlp\.gate\.weight", r"layers.\1.mlp.gate.kernel", True),
]
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"safetensors index names files that do not exist: {missing}")
    return files


def hf_tensor_name(key: str) -> str:
    """Our parameter path -> the HF tensor name it is read from (for error messages)."""
    if key == "embed_tokens":
        return "model.embed_tokens.weight"
    if key == "lm_head":
        return "lm_head.weight"
    if m := re.fullmatch(r"layers\.(\d+)\.mlp\.(gate|up|down)_proj", key):  # stacked experts
        return f"model.layers.{m[1]}.mlp.experts.*.{m[2]}_proj.weight"
    return "model." + re.sub(r"\.kernel$", ".weight", key)


def convert_hf_tensors(
    named: dict[str, np.ndarray],
    cfg: ModelConfig,
    *,
    strict: bool = True,
    problems: dict[str, list[str]] | None = None,
) -> dict[str, np.ndarray]:
    """HF tensor names/layouts -> our parameter paths/layouts.

    With `strict`, unknown names or incomplete expert sets raise CheckpointError here.
    Otherwise unknown tensors are passed through under their HF name (so `assign_params`
    reports them as unexpected, together with everything else), and missing experts are
    appended to `problems["missing"]` (their stacked parameter is then left out).
    """
    out: dict[str, np.ndarray] = {}
    if cfg.architecture == "gpt_oss":
        out, named = convert_gpt_oss_tensors(named)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = defaultdict(dict)
    unknown = []
    for name, arr in named.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some exporters save; recomputed from the config
        if m := _EXPERT.fullmatch(name):
            experts[(int(m[1]), m[3])][int(m[2])] = arr.T
            continue
        if m := _FUSED_EXPERT.fullmatch(name):
            layer = int(m[1])
            if m[2] == "gate_up_proj":  # [E, 2I, D] -> gate/up [E, D, I]
                gate, up = np.split(arr, 2, axis=1)
                out[f"layers.{layer}.mlp.gate_proj"] = np.swapaxes(gate, 1, 2)
                out[f"layers.{layer}.mlp.up_proj"] = np.swapaxes(up, 1, 2)
            else:  # [E, D, I] -> [E, I, D]
                out[f"layers.{layer}.mlp.down_proj"] = np.swapaxes(arr, 1, 2)
            continue
        for pattern, template, transpose in _KEY_MAP:
            if re.fullmatch(pattern, name):
                out[re.sub(pattern, template, name)] = arr.T if transpose else arr
                break
        else:
            unknown.append(name)
            out[name] = arr
    missing_experts = []
    for (layer, kind), per_expert in sorted(experts.items()):
        absent = [e for e in range(cfg.num_experts) if e not in per_expert]
        extra = [e for e in per_expert if not 0 <= e < cfg.num_experts]
        if absent or extra:
            missing_experts += [f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj.weight" for e in absent]
            for e in extra:
                out[f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj.weight"] = per_expert[e].T
            if absent:
                continue
        out[f"layers.{layer}.mlp.{kind}_proj"] = np.stack([per_expert[e] for e in range(cfg.num_experts)])
    if strict and (unknown or missing_experts):
        raise CheckpointError(
            "checkpoint does not match the model:"
            + (f"\n  unknown tensors: {unknown}" if unknown else "")
            + (f"\n  missing experts: {missing_experts}" if missing_experts else "")
        )
    if problems is not None:
        problems.setdefault("missing", []).extend(missing_experts)
    if cfg.tie_word_embeddings:
        out.pop("lm_head", None)  # tied: some exporters still write a copy
    return out


def load_hf_model(model_dir: str | Path, *, dtype: str = "float32") -> CausalLM:
    """Load a CausalLM from an HF directory with config.json and safetensors weights."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    cfg = ModelConfig.from_json_file(model_dir / "config.json", dtype=dtype)
    named: dict[str, np.ndarray] = {}
    for f in _safetensors_files(model_dir):
        # framework="flax" reads bf16 too (numpy has no bfloat16 dtype of its own); keep
        # those staging arrays on the host rather than round-tripping through an accelerator.
        with jax.default_device(jax.devices("cpu")[0]), safe_open(str(f), framework="flax") as fh:
            for key in fh.keys():
                tensor = np.asarray(fh.get_tensor(key))
                # integers stay as they are: GPT-OSS's MXFP4 blocks and scales (checkpoints.gpt_oss)
                named[key] = tensor if np.issubdtype(tensor.dtype, np.integer) else tensor.astype(np.float32)
    model = abstract_model(cfg)
    problems: dict[str, list[str]] = {}
    tensors = convert_hf_tensors(named, cfg, strict=False, problems=problems)
    missing_experts = problems.get("missing", [])
    # a stack with absent experts is reported expert by expert, not again as a whole
    partial = {f"layers.{n.split('.')[2]}.mlp.{n.split('.')[-2]}" for n in missing_experts}
    assign_params(
        model, tensors, source=str(model_dir), optional=partial if missing_experts else (),
        # our keys never start with "model."; passed-through unknown tensors keep their HF name
        describe=lambda k: k if k in named or k.startswith("model.") else f"{hf_tensor_name(k)} ({k})",
        extra_missing=missing_experts,
    )
    return model

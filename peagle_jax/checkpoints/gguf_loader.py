"""GGUF checkpoints (llama.cpp format) -> CausalLM, dequantized with the `gguf` package.

Two layout facts matter: GGUF stores 2-D weights as [out, in] (numpy shape is the reverse of
GGUF's), and llama.cpp's converter permutes the rows of llama q/k projections so that
rotary pairs are interleaved (Meta layout). We undo that permutation to get HF's
rotate-half layout. Qwen2/Qwen3 files are not permuted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from peagle_jax.checkpoints.gguf_blocks import GroupTensor, group_tensor
from peagle_jax.checkpoints.params import CheckpointError, assign_params
from peagle_jax.models.config import ModelConfig
from peagle_jax.models.layers import Linear
from peagle_jax.models.transformer import CausalLM, abstract_model

_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}

# (GGUF regex, our path template, transpose?)
_KEY_MAP: list[tuple[str, str, bool]] = [
    (r"token_embd\.weight", "embed_tokens", False),
    (r"output\.weight", "lm_head", True),
    (r"output_norm\.weight", "norm.weight", False),
    (r"blk\.(\d+)\.attn_norm\.weight", r"layers.\1.input_layernorm.weight", False),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"layers.\1.post_attention_layernorm.weight", False),
    (r"blk\.(\d+)\.attn_q\.weight", r"layers.\1.self_attn.q_proj.kernel", True),
    (r"blk\.(\d+)\.attn_k\.weight", r"layers.\1.self_attn.k_proj.kernel", True),
    (r"blk\.(\d+)\.attn_v\.weight", r"layers.\1.self_attn.v_proj.kernel", True),
    (r"blk\.(\d+)\.attn_output\.weight", r"layers.\1.self_attn.o_proj.kernel", True),
    (r"blk\.(\d+)\.attn_q\.bias", r"layers.\1.self_attn.q_proj.bias", False),
    (r"blk\.(\d+)\.attn_k\.bias", r"layers.\1.self_attn.k_proj.bias", False),
    (r"blk\.(\d+)\.attn_v\.bias", r"layers.\1.self_attn.v_proj.bias", False),
    (r"blk\.(\d+)\.attn_output\.bias", r"layers.\1.self_attn.o_proj.bias", False),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"layers.\1.self_attn.q_norm.weight", False),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"layers.\1.self_attn.k_norm.weight", False),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"layers.\1.mlp.gate_proj.kernel", True),
    (r"blk\.(\d+)\.ffn_up\.weight", r"layers.\1.mlp.up_proj.kernel", True),
    (r"blk\.(\d+)\.ffn_down\.weight", r"layers.\1.mlp.down_proj.kernel", True),
    (r"blk\.(\d+)\.ffn_gate_inp\.weight", r"layers.\1.mlp.gate.kernel", True),
]
_ROTARY = re.compile(r"blk\.\d+\.(attn_[qk])\.(weight|bias)")  # the tensors llama files permute
# Stacked experts, numpy shape [E, out, in] -> ours [E, in, out].
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    if len(f.data) == 1 and not f.types or (len(f.data) == 1 and f.types[0] != 9):  # scalar
        part = f.parts[f.data[0]]
        if f.types and f.types[0] == 8:  # string
            return bytes(part).decode("utf-8")
        return part.tolist()[0]
    return [f.parts[i].tolist() for i in f.data]


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation ([out, in] or [out] layout)."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def gguf_config(reader, *, dtype: str = "float32") -> ModelConfig:
    arch_name = _field(reader, "general.architecture")
    if arch_name not in _ARCH:
        raise ValueError(f"unsupported GGUF architecture {arch_name!r}; supported: {sorted(_ARCH)}")
    a = arch_name
    hidden = int(_field(reader, f"{a}.embedding_length"))
    heads = int(_field(reader, f"{a}.attention.head_count"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    names = {t.name for t in reader.tensors}
    rope_type = _field(reader, f"{a}.rope.scaling.type")
    rope_scaling = None
    if rope_type == "linear":
        rope_scaling = (("factor", float(_field(reader, f"{a}.rope.scaling.factor", 1.0))), ("rope_type", "linear"))
    elif rope_type not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {rope_type!r} is not supported; supported: linear")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    n_layers = int(_field(reader, f"{a}.block_count"))
    n_experts = int(_field(reader, f"{a}.expert_count", 0) or 0)
    # GGUF has no decoder_sparse_step / mlp_only_layers: a layer is sparse iff it has experts
    dense_layers = tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_exps.weight" not in names)
    return ModelConfig(
        architecture=_ARCH[a],
        vocab_size=len(tokens.data),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{a}.feed_forward_length", 0) or 0),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{a}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{a}.attention.key_length", hidden // heads)),
        # stored as float32 (1e-5 reads back as 9.9999997e-06): take its shortest decimal form
        rms_norm_eps=float(np.format_float_positional(
            np.float32(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)), trim="-")),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        num_experts=n_experts,
        mlp_only_layers=dense_layers if n_experts else (),
        num_experts_per_tok=int(_field(reader, f"{a}.expert_used_count", 0) or 0),
        moe_intermediate_size=int(_field(reader, f"{a}.expert_feed_forward_length", 0) or 0),
        norm_topk_prob=arch_name == "qwen3moe",  # Qwen3-MoE releases normalise top-k weights
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
        dtype=dtype,
    )


def load_gguf_model(path: str | Path, *, dtype: str = "float32") -> CausalLM:
    """Load and dequantize a GGUF file into a CausalLM."""
    return _load(Path(path), dtype, keep_blocks=False)[0]


def load_gguf_model_with_blocks(path: str | Path, *,
                                dtype: str = "bfloat16") -> tuple[CausalLM, dict[str, GroupTensor]]:
    """A GGUF file as a CausalLM whose Linear weights (and untied lm_head) stay in the file's own
    blocks wherever a kernel format holds them exactly (`gguf_blocks.GROUP_TYPES`): those are
    never dequantized, their `kernel` (and `lm_head`) is None, and the blocks come back by module
    path ("layers.0.self_attn.q_proj", "lm_head"; "embed_tokens" for a tied lm_head, whose
    table stays dequantized for the embedding) for `models.options.pack_cpu_matmuls`. Other
    tensors load as `load_gguf_model` loads them."""
    return _load(Path(path), dtype, keep_blocks=True)


def _linear_path(name: str) -> str | None:
    """The module path of a GGUF Linear weight ("blk.0.attn_q.weight" -> "layers.0.self_attn.q_proj",
    "output.weight" -> "lm_head"), None for other tensors."""
    return next((re.sub(pattern, template, name).removesuffix(".kernel")
                 for pattern, template, transpose in _KEY_MAP if transpose and re.fullmatch(pattern, name)), None)


def _load(path: Path, dtype: str, *, keep_blocks: bool) -> tuple[CausalLM, dict[str, GroupTensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = GGUFReader(str(path))
    cfg = gguf_config(reader, dtype=dtype)
    # llama files permute the q / k rows (module docstring): their head counts, by tensor kind
    heads = ({"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
             if cfg.architecture == "llama" else {})
    tensors: dict[str, np.ndarray] = {}
    blocks: dict[str, GroupTensor] = {}
    for t in reader.tensors:
        rotary = _ROTARY.fullmatch(t.name)
        n_heads = heads.get(rotary[1]) if rotary else None
        linear = _linear_path(t.name) if keep_blocks and len(t.shape) == 2 else None
        if keep_blocks and t.name == "token_embd.weight" and cfg.tie_word_embeddings:
            linear = "embed_tokens"
        if linear is not None:
            in_features, out_features = (int(x) for x in t.shape)
            order = None if n_heads is None else _unpermute_rotary(np.arange(out_features), n_heads)
            found = group_tensor(t.data, t.tensor_type, out_features, in_features, row_order=order)
            if found is not None:
                blocks[linear] = found
                if linear != "embed_tokens":  # the tied table also embeds: it stays dequantized too
                    continue
        arr = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape])))
        arr = np.asarray(arr, dtype=np.float32)
        if n_heads is not None:
            arr = _unpermute_rotary(arr, n_heads)
        if m := _EXPERTS.fullmatch(t.name):
            tensors[f"layers.{m[1]}.mlp.{m[2]}_proj"] = np.swapaxes(arr, 1, 2)
            continue
        for pattern, template, transpose in _KEY_MAP:
            if re.fullmatch(pattern, t.name):
                tensors[re.sub(pattern, template, t.name)] = arr.T if transpose else arr
                break
        else:
            if t.name == "rope_freqs.weight":
                # llama3-style scaling is stored as per-frequency divisors of the rotary
                # frequencies (llama.cpp: theta / freq_factors[i]), not as metadata
                if cfg.rope_scaling is not None:
                    raise ValueError(f"{path}: both rope.scaling metadata and rope_freqs.weight")
                if arr.shape != (cfg.head_dim // 2,):
                    raise CheckpointError(f"{path}: rope_freqs.weight has shape {arr.shape}, "
                                          f"expected ({cfg.head_dim // 2},)")
                cfg = cfg.replace(rope_scaling=(
                    ("factors", tuple(float(x) for x in arr)), ("rope_type", "freq_factors")))
            else:
                tensors[t.name] = arr  # unknown: reported as unexpected, with everything else
    model = abstract_model(cfg)
    bad = []
    for module_path, node in nnx.iter_graph(model):  # kept as blocks: no dequantized copy
        kept = blocks.get(".".join(map(str, module_path))) if isinstance(node, Linear) else None
        if kept is not None:
            node.kernel = None
            if kept.shape != (node.in_features, node.out_features):
                bad.append(f"{'.'.join(map(str, module_path))}: checkpoint {kept.shape} vs model "
                           f"{(node.in_features, node.out_features)}")
    if "lm_head" in blocks:
        model.lm_head = None
        if blocks["lm_head"].shape != (cfg.hidden_size, cfg.vocab_size):
            bad.append(f"lm_head: checkpoint {blocks['lm_head'].shape} vs model {(cfg.hidden_size, cfg.vocab_size)}")
    if bad:
        raise CheckpointError(f"{path} does not match the model: " + "; ".join(bad))
    assign_params(model, tensors, source=str(path))
    return model, blocks


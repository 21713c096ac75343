"""Draft-head checkpoints: EAGLE-3 / P-EAGLE heads <-> `model.safetensors` + `config.json`.

Two on-disk layouts, both loadable by vLLM's `llama_eagle3.py`:

* ``"aws"``: the original EAGLE-3 naming, also used by the AWS P-EAGLE releases. Layer 0 is
  ``midlayer.*``, later layers ``layers.{i}.*``; ``config.json`` is a Llama config plus the
  EAGLE fields (``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual``) and, for P-EAGLE,
  ``ptd_token_id`` / ``parallel_drafting`` / ``num_depths``.
* ``"speculators"``: the vllm-project/speculators format. Every layer is ``layers.{i}.*``;
  ``config.json`` has ``speculators_model_type`` ("peagle" or "eagle3"), a
  ``transformer_layer_config`` (the Llama config of the draft layers) and a
  ``speculators_config`` block (algorithm, proposal methods, verifier).

Tensors are in torch orientation: every Linear weight is [out, in] (we store [in, out]), the
lm_head is [Vd, H], ``mask_hidden`` is [1, 1, 3*Ht], ``d2t`` is int64 [Vd] (target id = draft
id + d2t[draft id]) and ``t2d`` is bool [V]. ``embed_tokens`` and ``lm_head`` may be left out
(vLLM then shares the target's); `load_drafter` fills them from a target model.

Heads above `MAX_SHARD_BYTES` (20 MiB) are written as HF shards with a
``model.safetensors.index.json``, as transformers and vLLM write and read large checkpoints.

Saves are atomic: everything is written and fsynced in a temporary sibling directory, which
then replaces the destination (the old directory is renamed aside first and deleted only once
the new one is in place).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save as _st_serialize

from peagle_jax.checkpoints.params import CheckpointError, assign_params, raise_if_mismatched
from peagle_jax.drafters.config import DrafterConfig
from peagle_jax.drafters.eagle3 import Eagle3Drafter
from peagle_jax.models.config import ModelConfig
from peagle_jax.pytree_paths import param_paths

Layout = Literal["aws", "speculators"]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Heads above this size are written as HF shards (model-0000i-of-0000n.safetensors + an index),
# which keeps every file of a committed head small; a tensor larger than this gets a shard alone.
MAX_SHARD_BYTES = 20 * 2**20

_SAVE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# Config keys under which a P-EAGLE mask (placeholder) token id may appear.
_MASK_ID_KEYS = ("ptd_token_id", "pard_token", "mask_token_id")
# Our target families -> the HF `architectures` entry of the verifier.
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# transformers' LlamaConfig defaults, for speculators configs saved as a diff dict.
_LLAMA_DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
)


# --------------------------------------------------------------------------- name mapping


def _torch_name(path: str, layout: Layout) -> tuple[str, str]:
    """Our parameter path -> (checkpoint key, transform), transform in {copy, T, mask}."""
    if path == "embed_tokens":
        return "embed_tokens.weight", "copy"
    if path == "lm_head":
        return "lm_head.weight", "T"
    if path == "mask_hidden":
        return "mask_hidden", "mask"
    parts = path.split(".")
    if parts[0] == "layers":
        i = int(parts[1])
        prefix = "midlayer" if (layout == "aws" and i == 0) else f"layers.{i}"
        parts = prefix.split(".") + parts[2:]
    if parts[-1] == "kernel":
        return ".".join(parts[:-1] + ["weight"]), "T"
    return ".".join(parts), "copy"  # RMSNorm weights, biases


def _to_torch(arr: np.ndarray, transform: str, fc_in: int) -> np.ndarray:
    if transform == "T":
        return np.ascontiguousarray(arr.T)
    if transform == "mask":
        return arr.reshape(1, 1, fc_in)
    return arr


def _from_torch(arr: np.ndarray, transform: str) -> np.ndarray:
    if transform == "T":
        return arr.T
    if transform == "mask" and arr.ndim > 1 and all(d == 1 for d in arr.shape[:-1]):
        return arr.reshape(arr.shape[-1])  # [1, 1, 3Ht] (AWS, speculators) or [1, 3Ht] -> [3Ht]
    return arr


def _vocab_maps(d2t: np.ndarray, vocab_size: int) -> np.ndarray:
    """t2d (bool [V]) from d2t; checks that d2t maps into the target vocabulary."""
    target_ids = np.arange(d2t.shape[0], dtype=np.int64) + d2t.astype(np.int64)
    bad = np.flatnonzero((target_ids < 0) | (target_ids >= vocab_size))
    if bad.size:
        raise ValueError(f"d2t maps draft ids {bad[:8].tolist()} outside the target vocab [0, {vocab_size})")
    t2d = np.zeros((vocab_size,), dtype=bool)
    t2d[target_ids] = True
    return t2d


# --------------------------------------------------------------------------- save


def _rope_scaling_dict(cfg: DrafterConfig) -> dict[str, Any] | None:
    return dict(cfg.rope_scaling) if cfg.rope_scaling else None


def _llama_fields(cfg: DrafterConfig, dtype: str, target_config: ModelConfig | None) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=_rope_scaling_dict(cfg),
        vocab_size=cfg.vocab_size,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    if target_config is not None:
        fields["max_position_embeddings"] = target_config.max_position_embeddings
        if target_config.bos_token_id is not None:
            fields["bos_token_id"] = target_config.bos_token_id
        if target_config.eos_token_ids:
            eos = list(target_config.eos_token_ids)
            fields["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return fields


def _config_json(
    cfg: DrafterConfig,
    layout: Layout,
    dtype: str,
    target_config: ModelConfig | None,
    verifier_name: str | None,
) -> dict[str, Any]:
    aux = cfg.aux_layer_ids
    if aux is None and target_config is not None:
        aux = target_config.eagle_aux_layer_ids
    aux = list(aux) if aux is not None else None
    llama = _llama_fields(cfg, dtype, target_config)
    peagle = cfg.parallel_drafting
    if layout == "aws":
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            **llama,
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "norm_before_residual": cfg.norm_before_residual,
        }
        if aux is not None:
            out["eagle_aux_hidden_state_layer_ids"] = aux
        if peagle:
            out["ptd_token_id"] = cfg.mask_token_id
            out["parallel_drafting"] = True
            out["num_depths"] = cfg.num_depths
        return out
    algorithm = "peagle" if peagle else "eagle3"
    verifier_arch = [_HF_ARCHITECTURES[target_config.architecture]] if target_config is not None else []
    out = {
        "speculators_model_type": algorithm,
        "architectures": ["PEagleSpeculator" if peagle else "Eagle3Speculator"],
        "transformer_layer_config": {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], **llama,
        },
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": False,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": aux,
        "embed_requires_grad": bool(peagle),
        "torch_dtype": dtype,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.num_depths}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": verifier_arch},
        },
    }
    if peagle:
        out["mask_token_id"] = cfg.mask_token_id
    return out


def drafter_tensors(
    drafter: Eagle3Drafter,
    *,
    layout: Layout = "aws",
    include_embed_tokens: bool = True,
    include_lm_head: bool = True,
    dtype: str = "float32",
) -> dict[str, np.ndarray]:
    """The checkpoint tensors (torch names and orientation) of `drafter`, as numpy arrays."""
    if layout not in ("aws", "speculators"):
        raise ValueError(f"unknown layout {layout!r}; expected 'aws' or 'speculators'")
    if dtype not in _SAVE_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(_SAVE_DTYPES)}")
    cfg = drafter.config
    float_dtype = _SAVE_DTYPES[dtype]
    out: dict[str, np.ndarray] = {}
    for path, param in param_paths(drafter).items():
        if path == "embed_tokens" and not include_embed_tokens:
            continue
        if path == "lm_head" and not include_lm_head:
            continue
        name, transform = _torch_name(path, layout)
        arr = np.asarray(param[...]).astype(float_dtype)
        out[name] = _to_torch(arr, transform, cfg.fc_in_features)
    d2t = np.asarray(drafter.d2t[...]).astype(np.int64)
    out["d2t"] = d2t
    out["t2d"] = _vocab_maps(d2t, cfg.vocab_size)
    return out


def _write_tensors(tensors: Mapping[str, np.ndarray], file: Path) -> None:
    """Serialise `tensors` to a safetensors file and fsync it (tests patch this to fail)."""
    data = _st_serialize(dict(tensors), metadata={"format": "pt"})
    with open(file, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _shards(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    """Split `tensors` (in key order) into groups of at most `max_bytes`, a larger tensor alone."""
    groups: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key, arr in tensors.items():
        if groups[-1] and size + arr.nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][key] = arr
        size += arr.nbytes
    return groups


def _write_weights(tensors: Mapping[str, np.ndarray], directory: Path, max_bytes: int) -> None:
    """One `model.safetensors`, or HF shards plus `model.safetensors.index.json` past `max_bytes`."""
    groups = _shards(tensors, max_bytes)
    if len(groups) == 1:
        _write_tensors(groups[0], directory / WEIGHTS_NAME)
        return
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        _write_tensors(group, directory / name)
        weight_map.update(dict.fromkeys(group, name))
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))}, "weight_map": weight_map}
    _write_text(json.dumps(index, indent=2) + "\n", directory / INDEX_NAME)


def _is_ours(name: str) -> bool:
    return name in (WEIGHTS_NAME, INDEX_NAME, CONFIG_NAME) or _SHARD_NAME.fullmatch(name) is not None


def _write_text(text: str, file: Path) -> None:
    with open(file, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _replace_dir(tmp: Path, dest: Path) -> None:
    """Put the complete directory `tmp` at `dest`; an existing `dest` survives until then."""
    parent = dest.parent
    aside = None
    if dest.exists():
        aside = parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dest, aside)
    try:
        os.rename(tmp, dest)
    except BaseException:
        if aside is not None:
            os.rename(aside, dest)  # put the previous checkpoint back
        raise
    _fsync_dir(parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def save_drafter(
    drafter: Eagle3Drafter,
    path: str | Path,
    *,
    layout: Layout = "aws",
    target_config: ModelConfig | None = None,
    verifier_name: str | None = None,
    include_embed_tokens: bool = True,
    include_lm_head: bool = True,
    dtype: str = "float32",
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write `drafter` as a directory with `model.safetensors` and `config.json`.

    `layout` is "aws" (EAGLE-3 / AWS P-EAGLE naming, `midlayer.*`) or "speculators".
    `target_config` (the verifier's ModelConfig) fills the tap ids when the drafter has none,
    the verifier architecture and max_position_embeddings, and is checked for compatibility.
    `include_embed_tokens=False` / `include_lm_head=False` leave those tensors out (loaders
    then share the target's). The destination is replaced atomically; an existing
    destination must hold only a previous checkpoint (config.json, model.safetensors or its
    shards). Weights above `max_shard_bytes` are written as HF shards with an index, which
    vLLM and transformers read as they read a single file.
    Returns the destination path.
    """
    cfg: DrafterConfig = drafter.config
    dest = Path(path)
    if target_config is not None:
        problems = []
        if target_config.hidden_size != cfg.target_hidden_size:
            problems.append(
                f"hidden_size {target_config.hidden_size} vs drafter target_hidden_size {cfg.target_hidden_size}"
            )
        if target_config.vocab_size != cfg.vocab_size:
            problems.append(f"vocab_size {target_config.vocab_size} vs drafter vocab_size {cfg.vocab_size}")
        if problems:
            raise ValueError("target_config does not match the drafter: " + "; ".join(problems))
    if cfg.parallel_drafting and cfg.mask_token_id is None:
        raise ValueError("parallel-drafting drafter has no mask_token_id; cannot write a P-EAGLE checkpoint")
    if cfg.parallel_drafting and not include_embed_tokens:
        warnings.warn(
            "saving a P-EAGLE head without embed_tokens: loaders will use the target's table, "
            "so a trained mask-token embedding row would be lost",
            stacklevel=2,
        )
    tensors = drafter_tensors(
        drafter, layout=layout, include_embed_tokens=include_embed_tokens,
        include_lm_head=include_lm_head, dtype=dtype,
    )
    config = _config_json(cfg, layout, dtype, target_config, verifier_name)

    if dest.exists():
        if not dest.is_dir():
            raise FileExistsError(f"{dest} exists and is not a directory")
        foreign = sorted(p.name for p in dest.iterdir() if not _is_ours(p.name))
        if foreign:
            raise FileExistsError(
                f"{dest} holds files that are not part of a drafter checkpoint ({', '.join(foreign)}); "
                "refusing to replace it"
            )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_weights(tensors, tmp, max_shard_bytes)
        _write_text(json.dumps(config, indent=2, sort_keys=False) + "\n", tmp / CONFIG_NAME)
        _fsync_dir(tmp)
        _replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


# --------------------------------------------------------------------------- load


def read_tensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """Every tensor a head directory holds (one file or HF shards); bf16 as ml_dtypes.bfloat16."""
    from peagle_jax.checkpoints.hf import _safetensors_files

    named: dict[str, np.ndarray] = {}
    for f in _safetensors_files(Path(model_dir)):
        with safe_open(str(f), framework="numpy") as fh:  # bf16 comes back as ml_dtypes.bfloat16
            for key in fh.keys():
                named[key] = fh.get_tensor(key)
    return named


def tensor_names(model_dir: str | Path) -> set[str]:
    """The tensor names a head directory holds (one file or HF shards), without reading them."""
    from peagle_jax.checkpoints.hf import _safetensors_files

    names: set[str] = set()
    for f in _safetensors_files(Path(model_dir)):
        with safe_open(str(f), framework="numpy") as fh:
            names.update(fh.keys())
    return names


def _mask_token_id(raw: dict[str, Any]) -> int | None:
    for key in _MASK_ID_KEYS:
        if raw.get(key) is not None:
            return int(raw[key])
    dflash = raw.get("dflash_config") or {}
    if dflash.get("mask_token_id") is not None:
        return int(dflash["mask_token_id"])
    return None


def _head_fields(raw: dict[str, Any], source: str) -> tuple[dict[str, Any], bool, bool, Any]:
    """(Llama layer config, declared P-EAGLE, default norm_before_residual, num_depths) per layout.

    The speculators and AWS layouts keep these in different places and default them differently.
    """
    spec_type = raw.get("speculators_model_type")
    if spec_type is not None:
        if spec_type not in ("eagle3", "peagle"):
            raise CheckpointError(
                f"{source}: speculators_model_type {spec_type!r} is not an EAGLE-3 / P-EAGLE head"
            )
        layer_cfg = dict(raw.get("transformer_layer_config") or raw.get("transformer_config") or {})
        for k, v in _LLAMA_DEFAULTS.items():
            layer_cfg.setdefault(k, v)
        declared_peagle = spec_type == "peagle"
        default_nbr = not declared_peagle  # vLLM: eagle3 defaults to True, peagle to False
        methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
        num_depths = methods[0].get("speculative_tokens")
    else:
        layer_cfg = dict(raw)
        declared_peagle = bool(raw.get("parallel_drafting"))
        default_nbr = False  # vLLM llama_eagle3: getattr(config, "norm_before_residual", False)
        num_depths = raw.get("num_depths")
    return layer_cfg, declared_peagle, default_nbr, num_depths


def _check_supported_options(raw: dict[str, Any], source: str) -> None:
    """Refuse draft-head variants whose extra norms / inputs this drafter does not implement."""
    unsupported = [k for k in ("norm_before_fc", "fc_norm", "norm_output") if raw.get(k)]
    eagle_cfg = raw.get("eagle_config") or {}
    if eagle_cfg.get("use_aux_hidden_state") is False:
        unsupported.append("eagle_config.use_aux_hidden_state=false")
    if unsupported:
        raise CheckpointError(f"{source}: draft-head options not implemented here: {unsupported}")


def _layer_config(layer_cfg: dict[str, Any], source: str) -> ModelConfig:
    """The shared Llama fields, parsed (and validated: hidden_act, rope type, ...) as the target's are."""
    try:
        return ModelConfig.from_hf_dict({**layer_cfg, "model_type": "llama"})
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from e


def _aux_layers(
    raw: dict[str, Any], tensors: Mapping[str, np.ndarray], target_hidden: int | float
) -> tuple[tuple[int, ...] | None, int]:
    """(tap layer ids or None, number of taps); without ids the fc width gives the count."""
    eagle_cfg = raw.get("eagle_config") or {}
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
    aux = tuple(int(i) for i in aux) if aux else None
    num_aux = len(aux) if aux else 3
    fc = tensors.get("fc.weight")
    if fc is not None and fc.ndim == 2 and aux is None and fc.shape[1] % target_hidden == 0:
        num_aux = fc.shape[1] // target_hidden  # no tap ids: trust the fc width
    return aux, num_aux


def _parallel_drafting(
    raw: dict[str, Any], tensors: Mapping[str, np.ndarray], declared_peagle: bool, source: str
) -> tuple[int | None, bool]:
    """(mask token id, parallel drafting): P-EAGLE needs both `mask_hidden` and a mask token id."""
    mask_id = _mask_token_id(raw)
    has_mask_hidden = "mask_hidden" in tensors
    if declared_peagle:
        missing = []
        if not has_mask_hidden:
            missing.append("the 'mask_hidden' tensor")
        if mask_id is None:
            missing.append(f"a mask token id in config.json ({' / '.join(_MASK_ID_KEYS)})")
        if missing:
            raise CheckpointError(
                f"{source}: config declares a P-EAGLE (parallel-drafting) head but is missing "
                + " and ".join(missing)
            )
    parallel = has_mask_hidden and mask_id is not None
    if has_mask_hidden and not parallel:
        warnings.warn(
            f"{source}: checkpoint has 'mask_hidden' but config.json has no mask token id "
            f"({' / '.join(_MASK_ID_KEYS)}); loading it as a sequential EAGLE-3 head",
            stacklevel=4,  # the caller of load_drafter (via _parse_config)
        )
    return mask_id, parallel


def _parse_config(
    raw: dict[str, Any], tensors: Mapping[str, np.ndarray], dtype: str, source: str
) -> DrafterConfig:
    layer_cfg, declared_peagle, default_nbr, num_depths = _head_fields(raw, source)
    _check_supported_options(raw, source)
    llama = _layer_config(layer_cfg, source)
    target_hidden = raw.get("target_hidden_size") or llama.hidden_size
    aux, num_aux = _aux_layers(raw, tensors, target_hidden)
    mask_id, parallel = _parallel_drafting(raw, tensors, declared_peagle, source)

    return DrafterConfig(
        hidden_size=llama.hidden_size,
        num_hidden_layers=llama.num_hidden_layers,
        num_attention_heads=llama.num_attention_heads,
        num_key_value_heads=llama.num_key_value_heads,
        head_dim=llama.head_dim,
        intermediate_size=llama.intermediate_size,
        vocab_size=llama.vocab_size,
        draft_vocab_size=int(raw.get("draft_vocab_size") or llama.vocab_size),
        target_hidden_size=int(target_hidden),
        num_aux_layers=num_aux,
        rms_norm_eps=llama.rms_norm_eps,
        rope_theta=llama.rope_theta,
        rope_scaling=llama.rope_scaling,
        norm_before_residual=bool(raw.get("norm_before_residual", default_nbr)),
        mask_token_id=mask_id if parallel else None,
        parallel_drafting=parallel,
        num_depths=int(num_depths) if num_depths else 8,
        aux_layer_ids=aux,
        dtype=dtype,
    )


def _check_config_present(model_dir: Path) -> None:
    """FileNotFoundError when `model_dir` has no config.json, pointing at a save interrupted mid-swap."""
    if not (model_dir / CONFIG_NAME).exists():
        hint = ""
        aside = sorted(model_dir.parent.glob(f".{model_dir.name}.old-*")) if model_dir.parent.exists() else []
        if not model_dir.exists() and aside:
            hint = f" (an interrupted save left the previous checkpoint at {aside[-1]})"
        raise FileNotFoundError(f"{model_dir} has no {CONFIG_NAME}{hint}")


def _check_target(target, cfg: DrafterConfig, source: str) -> None:
    tcfg = target.config
    problems = []
    if tcfg.vocab_size != cfg.vocab_size:
        problems.append(f"vocab_size {tcfg.vocab_size} vs drafter {cfg.vocab_size}")
    if tcfg.hidden_size != cfg.target_hidden_size:
        problems.append(f"hidden_size {tcfg.hidden_size} vs drafter target_hidden_size {cfg.target_hidden_size}")
    if problems:
        raise CheckpointError(f"{source}: target does not match the draft head: " + "; ".join(problems))


def _expected_tensors(drafter: Eagle3Drafter, layout: Layout) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """checkpoint key -> (our path, transform, expected shape in torch orientation)."""
    expected: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for ours, param in param_paths(drafter).items():
        name, transform = _torch_name(ours, layout)
        shape = tuple(param.value.shape)
        expected[name] = (ours, transform, shape[::-1] if transform == "T" else shape)
    return expected


def _match_tensors(
    named: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[str, str, tuple[int, ...]]],
    cfg: DrafterConfig,
) -> tuple[dict[str, np.ndarray], list[str], list[str]]:
    """(our path -> array in our orientation, unknown checkpoint keys, wrong-shape messages)."""
    unknown: list[str] = []
    bad: list[str] = []
    tensors: dict[str, np.ndarray] = {}
    for key, arr in named.items():
        if key in expected:
            ours, transform, want = expected[key]
            got = _from_torch(arr, transform)
            if transform == "mask":
                ok = got.shape == want
                want = (1, 1, *want)
            else:
                ok = arr.shape == want
            if ok:
                tensors[ours] = got
            else:
                bad.append(f"{key}: checkpoint {tuple(arr.shape)} vs model {want}")
        elif key == "mask_hidden" and not cfg.parallel_drafting:
            continue  # no mask token id: loaded as a sequential head (_parse_config warned)
        elif key not in ("d2t", "t2d") and not key.endswith("rotary_emb.inv_freq"):
            unknown.append(key)
    return tensors, unknown, bad


def _vocab_mapping(named: Mapping[str, np.ndarray], cfg: DrafterConfig) -> tuple[np.ndarray, bool, list[str]]:
    """(d2t, whether it is usable, problems): d2t absent = identity; t2d validated, otherwise unused (as in vLLM)."""
    bad: list[str] = []
    d2t = named.get("d2t")
    d2t_ok = True
    if d2t is None:
        d2t = np.zeros((cfg.draft_vocab_size,), np.int64)
    elif d2t.shape != (cfg.draft_vocab_size,) or not np.issubdtype(d2t.dtype, np.integer):
        bad.append(f"d2t: checkpoint {d2t.dtype} {tuple(d2t.shape)} vs model integer ({cfg.draft_vocab_size},)")
        d2t_ok = False
    else:
        ids = np.arange(cfg.draft_vocab_size) + d2t.astype(np.int64)
        if ((ids < 0) | (ids >= cfg.vocab_size)).any():
            bad.append(f"d2t: maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
            d2t_ok = False
    t2d = named.get("t2d")
    if t2d is not None and t2d.shape != (cfg.vocab_size,):
        bad.append(f"t2d: checkpoint {tuple(t2d.shape)} vs model ({cfg.vocab_size},)")
    return d2t, d2t_ok, bad


def _fill_absent(
    named: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[str, str, tuple[int, ...]]],
    tensors: dict[str, np.ndarray],
    target,
    cfg: DrafterConfig,
    d2t: np.ndarray,
    d2t_ok: bool,
) -> list[str]:
    """Fill absent embed_tokens / lm_head from `target` into `tensors`; returns the still-missing keys.

    vLLM shares the target's tables when a head leaves them out; the lm_head keeps the draft-vocab rows.
    """
    shared = {"embed_tokens.weight", "lm_head.weight"}
    missing: list[str] = []
    for name, (ours, _, _) in expected.items():
        if name in named:
            continue
        if name not in shared:
            missing.append(name)
        elif target is None:
            missing.append(f"{name} (the head shares the target's: pass target= to load it)")
        elif ours == "embed_tokens":
            tensors[ours] = np.asarray(target.embed_tokens[...])
        elif d2t_ok:
            cols = np.arange(cfg.draft_vocab_size) + d2t.astype(np.int64)
            tensors[ours] = np.asarray(target.lm_head_weight())[:, cols]  # [H, V] -> [H, Vd]
    return missing


def load_drafter(path: str | Path, *, target=None, dtype: str = "float32") -> Eagle3Drafter:
    """Load an EAGLE-3 / P-EAGLE head saved in the AWS or speculators layout.

    `target` (a CausalLM) supplies `embed_tokens` and the draft-vocab rows of its lm_head when
    the checkpoint leaves them out. Mismatched, missing or unknown tensors raise one
    CheckpointError naming all of them.
    """
    model_dir = Path(path)
    _check_config_present(model_dir)
    source = str(model_dir)
    raw = json.loads((model_dir / CONFIG_NAME).read_text())
    named = read_tensors(model_dir)
    cfg = _parse_config(raw, named, dtype, source)
    if target is not None:
        _check_target(target, cfg, source)

    layout: Layout = "aws" if any(k.startswith("midlayer.") for k in named) else "speculators"
    drafter = nnx.eval_shape(lambda: Eagle3Drafter(cfg, rngs=nnx.Rngs(0)))
    expected = _expected_tensors(drafter, layout)
    tensors, unknown, bad = _match_tensors(named, expected, cfg)
    d2t, d2t_ok, vocab_bad = _vocab_mapping(named, cfg)
    bad += vocab_bad
    missing = _fill_absent(named, expected, tensors, target, cfg, d2t, d2t_ok)
    raise_if_mismatched(f"{source} does not match the draft head ({layout} layout)", sorted(missing),
                        sorted(unknown), bad)
    assign_params(drafter, tensors, source=source)
    drafter.d2t.value = jnp.asarray(d2t, dtype=jnp.int32)
    return drafter


__all__ = ["drafter_tensors", "load_drafter", "save_drafter"]

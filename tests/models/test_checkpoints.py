"""Checkpoint loading: error reporting, sharded and bf16 safetensors, GGUF layouts.

Tiny HF models come from the `make_tiny_hf` fixture (conftest.py). Forward parity of the
HF-directory loader is covered by test_parity_hf.py; here loaded parameters are compared
directly, which needs no compiled forward pass.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import write_gguf

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from peagle_jax.checkpoints import CheckpointError, load_target  # noqa: E402
from peagle_jax.models.config import ModelConfig  # noqa: E402
from peagle_jax.models.layers import rope_inv_freq  # noqa: E402
from peagle_jax.pytree_paths import param_paths  # noqa: E402

SMALL = dict(num_hidden_layers=2)  # loading needs no depth


def _params(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(p.value) for k, p in param_paths(model).items()}


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        assert pa[k].shape == pb[k].shape, k
        np.testing.assert_array_equal(pa[k].astype(np.float32), pb[k].astype(np.float32), err_msg=k)


def _edit_safetensors(d: Path, fn) -> None:
    f = d / "model.safetensors"
    sd = safetensors_torch.load_file(str(f))
    fn(sd)
    safetensors_torch.save_file(sd, str(f), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- errors


def test_missing_unexpected_and_misshaped_reported_together(make_tiny_hf, tmp_path):
    make_tiny_hf("llama", **SMALL).save_pretrained(tmp_path)

    def corrupt(sd):
        del sd["model.layers.1.mlp.up_proj.weight"]  # missing
        sd["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)  # unknown to the loader
        sd["model.layers.7.self_attn.q_proj.weight"] = torch.zeros(64, 64)  # known name, no such layer
        sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 64)  # wrong shape (32, 64)

    _edit_safetensors(tmp_path, corrupt)
    with pytest.raises(CheckpointError) as exc:
        load_target(tmp_path)
    msg = str(exc.value)
    for name in ("model.layers.1.mlp.up_proj.weight", "model.layers.0.mlp.extra_proj.weight",
                 "model.layers.7.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert name in msg, (name, msg)
    assert "missing (1)" in msg and "unexpected (2)" in msg and "wrong shape (1)" in msg, msg
    assert isinstance(exc.value, ValueError)


def test_missing_expert_reported_with_other_errors(make_tiny_hf, tmp_path):
    make_tiny_hf("qwen3_moe", **SMALL).save_pretrained(tmp_path)

    def corrupt(sd):
        del sd["model.layers.1.mlp.experts.5.up_proj.weight"]
        sd["model.layers.0.mlp.gate.weight"] = torch.zeros(7, 64)  # router for 7 experts, not 8

    _edit_safetensors(tmp_path, corrupt)
    with pytest.raises(CheckpointError) as exc:
        load_target(tmp_path)
    msg = str(exc.value)
    assert "model.layers.1.mlp.experts.5.up_proj.weight" in msg, msg
    assert "model.layers.0.mlp.gate.weight" in msg and "wrong shape (1)" in msg, msg
    assert "missing (1)" in msg, msg  # the stacked up_proj is not reported a second time


def test_untied_checkpoint_without_lm_head(make_tiny_hf, tmp_path):
    make_tiny_hf("qwen2", tie_word_embeddings=False, **SMALL).save_pretrained(tmp_path)
    _edit_safetensors(tmp_path, lambda sd: sd.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        load_target(tmp_path)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(model_type="gpt2"), "unsupported model_type"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=1e4)), "rope_scaling type"),
        (dict(use_sliding_window=True), "sliding"),
    ],
)
def test_unsupported_configs_raise(change, match):
    cfg = dict(model_type="qwen2", vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)
    ModelConfig.from_hf_dict(cfg)  # the base is fine
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**cfg, **change})


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_target(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError):
        load_target(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_target(tmp_path)


# ----------------------------------------------------------------------------- layouts


def test_sharded_checkpoint(make_tiny_hf, tmp_path):
    hf = make_tiny_hf("qwen3", **SMALL)
    hf.save_pretrained(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    _assert_same_params(load_target(tmp_path / "sharded"), load_target(tmp_path / "one"))


def test_bf16_checkpoint(make_tiny_hf, tmp_path):
    hf = make_tiny_hf("llama", **SMALL)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    with open(tmp_path / "bf16" / "model.safetensors", "rb") as fh:  # really stored as BF16
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    hf.to(torch.float32).save_pretrained(tmp_path / "rounded_fp32")  # same bf16-rounded values
    ours = load_target(tmp_path / "bf16")
    assert {v.dtype for v in _params(ours).values()} == {np.dtype(np.float32)}
    _assert_same_params(ours, load_target(tmp_path / "rounded_fp32"))
    ours_bf16 = load_target(tmp_path / "bf16", dtype="bfloat16")
    assert {str(v.dtype) for v in _params(ours_bf16).values()} == {"bfloat16"}
    _assert_same_params(ours_bf16, ours)


def _rewrite_expert_layout(model_dir: Path) -> str:
    """Convert the saved experts to the other layout (per-expert hub <-> transformers 5 fused).

    Returns the layout now on disk ("fused" or "hub").
    """
    f = model_dir / "model.safetensors"
    sd = safetensors_torch.load_file(str(f))
    hub = {k for k in sd if ".mlp.experts." in k and k.split(".mlp.experts.")[1][0].isdigit()}
    out = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    layers = sorted({int(k.split(".")[2]) for k in sd if ".mlp.experts." in k})
    if hub:  # experts.{e}.{gate,up,down}_proj.weight -> experts.gate_up_proj [E,2I,D], down_proj [E,D,I]
        for i in layers:
            p = f"model.layers.{i}.mlp.experts"
            n = len({k for k in hub if k.startswith(p + ".")}) // 3
            gate = torch.stack([sd[f"{p}.{e}.gate_proj.weight"] for e in range(n)])
            up = torch.stack([sd[f"{p}.{e}.up_proj.weight"] for e in range(n)])
            out[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
            out[f"{p}.down_proj"] = torch.stack([sd[f"{p}.{e}.down_proj.weight"] for e in range(n)])
        layout = "fused"
    else:
        for i in layers:
            p = f"model.layers.{i}.mlp.experts"
            gate, up = sd[f"{p}.gate_up_proj"].chunk(2, dim=1)
            for e in range(gate.shape[0]):
                out[f"{p}.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{p}.{e}.up_proj.weight"] = up[e].contiguous()
                out[f"{p}.{e}.down_proj.weight"] = sd[f"{p}.down_proj"][e].contiguous()
        layout = "hub"
    f.unlink()
    safetensors_torch.save_file(out, str(f), metadata={"format": "pt"})
    return layout


def test_routed_expert_layouts_agree(make_tiny_hf, tmp_path):
    """Per-expert hub tensors and transformers 5's fused gate_up_proj/down_proj load the same."""
    hf = make_tiny_hf("qwen3_moe", **SMALL)
    hf.save_pretrained(tmp_path / "saved")
    hf.save_pretrained(tmp_path / "other")
    other = _rewrite_expert_layout(tmp_path / "other")
    names = set(safetensors_torch.load_file(str(tmp_path / "other" / "model.safetensors")))
    assert ("model.layers.1.mlp.experts.gate_up_proj" in names) == (other == "fused")
    a, b = load_target(tmp_path / "saved"), load_target(tmp_path / "other")
    _assert_same_params(a, b)
    # and both equal the torch experts (expert 3 of layer 1; ours are [E, in, out])
    p = _params(a)
    sd = hf.state_dict()
    if "model.layers.1.mlp.experts.gate_up_proj" in sd:  # transformers 5 keeps them fused in memory
        up = sd["model.layers.1.mlp.experts.gate_up_proj"][3].chunk(2, dim=0)[1]
    else:
        up = sd["model.layers.1.mlp.experts.3.up_proj.weight"]
    np.testing.assert_array_equal(p["layers.1.mlp.up_proj"][3], up.numpy().T)


# ----------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", dict(tie_word_embeddings=True)),
        ("llama", dict(attention_bias=True)),
        ("qwen2", {}),
        ("qwen3", dict(head_dim=24)),
        ("qwen3_moe", dict(decoder_sparse_step=2, num_hidden_layers=2)),
    ],
    ids=["llama_tied", "llama_bias", "qwen2", "qwen3", "qwen3_moe"],
)
def test_gguf_matches_hf_directory(make_tiny_hf, tmp_path, arch, overrides):
    """Same weights through both loaders (GGUF q/k un-permutation, names, experts, config)."""
    hf = make_tiny_hf(arch, **{**SMALL, **overrides})
    hf.save_pretrained(tmp_path / "hf")
    write_gguf(hf, tmp_path / "m.gguf")
    from_gguf, from_hf = load_target(tmp_path / "m.gguf"), load_target(tmp_path / "hf")
    _assert_same_params(from_gguf, from_hf)
    a, b = from_gguf.config, from_hf.config
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                  "tie_word_embeddings", "attention_bias", "qk_norm", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "norm_topk_prob", "rope_scaling"):
        assert getattr(a, field) == getattr(b, field), field
    if arch == "qwen3_moe":
        assert [a.is_moe_layer(i) for i in range(2)] == [b.is_moe_layer(i) for i in range(2)] == [False, True]


def _llama3_factors(theta, dim, factor, low, high, old_ctx):  # llama.cpp's converter, verbatim
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_gguf_rope_scaling(make_tiny_hf, tmp_path, kind):
    """llama3 GGUFs carry rope_freqs.weight, linear ones metadata; both must match HF's inv_freq."""
    if kind == "llama3":
        rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16, rope_theta=10000.0)
        hf = make_tiny_hf("llama", rope_parameters=rope, **SMALL)
        write_gguf(hf, tmp_path / "m.gguf", rope_freqs=_llama3_factors(10000.0, 16, 8.0, 1.0, 4.0, 16))
    else:
        hf = make_tiny_hf("llama", rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
                          **SMALL)
        write_gguf(hf, tmp_path / "m.gguf", linear_factor=2.0)
    hf.save_pretrained(tmp_path / "hf")
    ref = hf.model.rotary_emb.inv_freq.numpy()
    assert float(getattr(hf.model.rotary_emb, "attention_scaling", 1.0)) == 1.0
    for model in (load_target(tmp_path / "m.gguf"), load_target(tmp_path / "hf")):
        cfg = model.config
        ours = np.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        np.testing.assert_allclose(ours, ref, rtol=1e-6)
    if kind == "llama3":  # the scaling must actually change something at this size
        assert not np.allclose(ref, 1.0 / (10000.0 ** (np.arange(0, 16, 2) / 16)), rtol=1e-3)

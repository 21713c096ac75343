"""Draft-head checkpoint I/O: AWS (`midlayer.*`) and speculators layouts, round trips, errors."""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from peagle_jax.checkpoints import drafter_io
from peagle_jax.checkpoints.drafter_io import load_drafter, save_drafter
from peagle_jax.checkpoints.params import CheckpointError
from peagle_jax.drafters import DrafterConfig, create_drafter
from peagle_jax.models import ModelConfig, create_model
from peagle_jax.pytree_paths import param_paths

V, H, VD, MASK_ID = 96, 32, 40, 95
LLAMA3_ROPE = (
    ("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 64), ("rope_type", "llama3"),
)


@pytest.fixture(scope="module")
def target_cfg() -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
        aux_layer_ids=(1, 2, 3), max_position_embeddings=64,
    )


@pytest.fixture(scope="module")
def target(target_cfg):
    return create_model(target_cfg, seed=3)


def _draft_ids(seed: int = 0) -> np.ndarray:
    """A sorted reduced vocabulary (always containing the mask token) -> its d2t offsets."""
    rng = np.random.default_rng(seed)
    ids = np.sort(np.concatenate([rng.choice(V - 1, VD - 1, replace=False), [MASK_ID]]))
    return ids


def _make(target_cfg, *, peagle: bool, seed: int = 0, **overrides):
    if peagle:
        cfg = DrafterConfig.for_target(
            target_cfg, num_layers=2, parallel_drafting=True, mask_token_id=MASK_ID,
            draft_vocab_size=VD, num_depths=4, **overrides,
        )
    else:  # sequential EAGLE-3 head: 1 layer, llama3 rope, norm_before_residual
        cfg = DrafterConfig.for_target(
            target_cfg, num_layers=1, draft_vocab_size=VD, rope_scaling=LLAMA3_ROPE,
            norm_before_residual=True, **overrides,
        )
    d = create_drafter(cfg, seed=seed)
    rng = np.random.default_rng(100 + seed)
    for path, p in param_paths(d).items():  # O(1) activations, distinct norm weights
        shape = p[...].shape
        if path.endswith("norm.weight"):
            val = 1.0 + 0.2 * rng.standard_normal(shape)
        elif path.endswith("kernel"):
            val = rng.standard_normal(shape) / np.sqrt(shape[0])
        else:
            val = rng.standard_normal(shape)
        p.value = jnp.asarray(val, p[...].dtype)
    ids = _draft_ids(seed)
    d.d2t.value = jnp.asarray(ids - np.arange(VD), jnp.int32)
    return d


def _assert_same_params(a, b):
    pa, pb = param_paths(a), param_paths(b)
    assert sorted(pa) == sorted(pb)
    for k in pa:
        np.testing.assert_array_equal(np.asarray(pa[k][...]), np.asarray(pb[k][...]), err_msg=k)
    np.testing.assert_array_equal(np.asarray(a.d2t[...]), np.asarray(b.d2t[...]))


def _forward(d):
    b, r, s = 2, 5, 16
    rng = np.random.default_rng(7)
    tokens = jnp.asarray(rng.integers(0, V, (b, r)), jnp.int32)
    tokens = tokens.at[:, 2:].set(MASK_ID)
    feats = jnp.asarray(rng.standard_normal((b, r, d.config.hidden_size)), jnp.float32)
    positions = jnp.asarray(np.arange(r)[None] + np.array([[0], [3]]), jnp.int32)
    rows = jnp.asarray([[1, 2, 4], [0, 3, 4]], jnp.int32)
    out = d(tokens, feats, positions, d.init_cache(b, s), logit_rows=rows)
    return out, d.to_target_ids(jnp.argmax(out.logits, axis=-1))


def _keys(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(path / "model.safetensors"), framework="numpy") as fh:
        return {k: (str(fh.get_tensor(k).dtype), fh.get_tensor(k).shape) for k in fh.keys()}


def _layer_keys(prefix: str, first: bool) -> set[str]:
    norms = ["input_layernorm", "post_attention_layernorm"] + (["hidden_norm"] if first else [])
    return (
        {f"{prefix}.{n}.weight" for n in norms}
        | {f"{prefix}.self_attn.{p}_proj.weight" for p in "qkvo"}
        | {f"{prefix}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    )


@pytest.mark.parametrize("layout", ["aws", "speculators"])
@pytest.mark.parametrize("peagle", [True, False], ids=["peagle", "eagle3"])
def test_round_trip(tmp_path, target_cfg, layout, peagle):
    d = _make(target_cfg, peagle=peagle)
    path = save_drafter(d, tmp_path / "head", layout=layout, target_config=target_cfg)
    loaded = load_drafter(path)
    assert loaded.config == d.config
    _assert_same_params(d, loaded)
    (o1, ids1), (o2, ids2) = _forward(d), _forward(loaded)
    np.testing.assert_array_equal(np.asarray(o1.logits), np.asarray(o2.logits))
    np.testing.assert_array_equal(np.asarray(o1.prenorm), np.asarray(o2.prenorm))
    for l1, l2 in zip(o1.cache.layers, o2.cache.layers, strict=True):
        np.testing.assert_array_equal(np.asarray(l1.k), np.asarray(l2.k))
    np.testing.assert_array_equal(np.asarray(ids1), np.asarray(ids2))
    assert np.isin(np.asarray(ids1), _draft_ids()).all()  # draft ids map into the target vocab
    if peagle:
        np.testing.assert_array_equal(np.asarray(d.mask_feature()), np.asarray(loaded.mask_feature()))


def test_aws_peagle_keys_and_config(tmp_path, target_cfg):
    d = _make(target_cfg, peagle=True)
    path = save_drafter(d, tmp_path / "aws", layout="aws", target_config=target_cfg)
    keys = _keys(path)
    assert set(keys) == (
        {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "mask_hidden"}
        | _layer_keys("midlayer", True) | _layer_keys("layers.1", False)
    )
    qd, kvd, inter = 4 * 8, 2 * 8, 64
    assert keys["fc.weight"] == ("float32", (H, 3 * H))
    assert keys["midlayer.self_attn.q_proj.weight"] == ("float32", (qd, 2 * H))
    assert keys["midlayer.self_attn.k_proj.weight"] == ("float32", (kvd, 2 * H))
    assert keys["midlayer.self_attn.o_proj.weight"] == ("float32", (H, qd))
    assert keys["layers.1.self_attn.q_proj.weight"] == ("float32", (qd, H))
    assert keys["layers.1.mlp.down_proj.weight"] == ("float32", (H, inter))
    assert keys["layers.1.mlp.gate_proj.weight"] == ("float32", (inter, H))
    assert keys["lm_head.weight"] == ("float32", (VD, H))
    assert keys["embed_tokens.weight"] == ("float32", (V, H))
    assert keys["mask_hidden"] == ("float32", (1, 1, 3 * H))
    assert keys["d2t"] == ("int64", (VD,))
    assert keys["t2d"] == ("bool", (V,))
    t = load_file(str(path / "model.safetensors"))
    np.testing.assert_array_equal(np.flatnonzero(t["t2d"]), _draft_ids())
    np.testing.assert_array_equal(t["d2t"], _draft_ids() - np.arange(VD))
    np.testing.assert_array_equal(  # torch [out, in] orientation
        t["midlayer.self_attn.q_proj.weight"], np.asarray(d.layers[0].self_attn.q_proj.kernel[...]).T
    )
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    expected = dict(
        hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
        intermediate_size=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, vocab_size=V,
        draft_vocab_size=VD, target_hidden_size=H, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        norm_before_residual=False, ptd_token_id=MASK_ID, parallel_drafting=True, num_depths=4,
    )
    assert {k: cfg[k] for k in expected} == expected


def test_speculators_keys_and_config(tmp_path, target_cfg):
    d = _make(target_cfg, peagle=False)
    path = save_drafter(d, tmp_path / "spec", layout="speculators", target_config=target_cfg,
                        verifier_name="org/tiny-llama")
    assert set(_keys(path)) == (
        {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
        | _layer_keys("layers.0", True)
    )
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["draft_vocab_size"] == VD and cfg["target_hidden_size"] == H
    assert cfg["norm_before_residual"] is True and cfg["embed_requires_grad"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == V
    assert layer["rope_scaling"] == dict(LLAMA3_ROPE)
    assert cfg["speculators_config"] == {
        "algorithm": "eagle3",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 8}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]},
    }

    p = save_drafter(_make(target_cfg, peagle=True), tmp_path / "spec_p", layout="speculators")
    assert set(_keys(p)) == (
        {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "mask_hidden"}
        | _layer_keys("layers.0", True) | _layer_keys("layers.1", False)
    )
    cfg = json.loads((p / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["architectures"] == ["PEagleSpeculator"]
    assert cfg["mask_token_id"] == MASK_ID and cfg["embed_requires_grad"] is True
    assert cfg["speculators_config"]["algorithm"] == "peagle"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4


@pytest.mark.parametrize("layout", ["aws", "speculators"])
def test_omitted_embed_and_lm_head_come_from_target(tmp_path, target_cfg, target, layout):
    d = _make(target_cfg, peagle=False)
    ids = _draft_ids()
    d.embed_tokens.value = target.embed_tokens[...]
    d.lm_head.value = target.lm_head_weight()[:, ids]
    path = save_drafter(d, tmp_path / "h", layout=layout, include_embed_tokens=False, include_lm_head=False)
    keys = set(_keys(path))
    assert "embed_tokens.weight" not in keys and "lm_head.weight" not in keys
    _assert_same_params(d, load_drafter(path, target=target))
    with pytest.raises(CheckpointError, match=r"embed_tokens\.weight") as e:
        load_drafter(path)
    assert "lm_head.weight" in str(e.value) and "target=" in str(e.value)


def test_peagle_without_embed_warns(tmp_path, target_cfg):
    with pytest.warns(UserWarning, match="mask-token embedding"):
        save_drafter(_make(target_cfg, peagle=True), tmp_path / "h", include_embed_tokens=False)


@pytest.mark.parametrize("layout", ["aws", "speculators"])
def test_peagle_missing_mask_pieces(tmp_path, target_cfg, layout):
    path = save_drafter(_make(target_cfg, peagle=True), tmp_path / "h", layout=layout)
    weights, config = path / "model.safetensors", path / "config.json"
    good_tensors, good_cfg = load_file(str(weights)), json.loads(config.read_text())

    save_file({k: v for k, v in good_tensors.items() if k != "mask_hidden"}, str(weights))
    with pytest.raises(CheckpointError, match="P-EAGLE.*'mask_hidden' tensor"):
        load_drafter(path)

    save_file(good_tensors, str(weights))
    id_key = "ptd_token_id" if layout == "aws" else "mask_token_id"
    config.write_text(json.dumps({k: v for k, v in good_cfg.items() if k != id_key}))
    with pytest.raises(CheckpointError, match="P-EAGLE.*mask token id") as e:
        load_drafter(path)
    assert "mask_hidden" not in str(e.value)

    if layout == "aws":  # undeclared (no parallel_drafting flag) and no id: a sequential head
        cfg = {k: v for k, v in good_cfg.items() if k not in ("ptd_token_id", "parallel_drafting")}
        config.write_text(json.dumps(cfg))
        with pytest.warns(UserWarning, match="sequential EAGLE-3"):
            d = load_drafter(path)
        assert not d.config.parallel_drafting and d.mask_hidden is None


def test_mismatch_lists_every_offending_key(tmp_path, target_cfg):
    path = save_drafter(_make(target_cfg, peagle=True), tmp_path / "h", layout="aws")
    t = load_file(str(path / "model.safetensors"))
    del t["norm.weight"]
    t["layers.1.mlp.up_proj.weight"] = t["layers.1.mlp.up_proj.weight"][:-1]
    t["midlayer.extra.weight"] = np.zeros(3, np.float32)
    t["d2t"] = t["d2t"][:-1]
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_drafter(path)
    msg = str(e.value)
    for needle in ("norm.weight", "layers.1.mlp.up_proj.weight", "midlayer.extra.weight", "d2t"):
        assert needle in msg, (needle, msg)


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, target_cfg, monkeypatch):
    good = _make(target_cfg, peagle=True, seed=0)
    dest = save_drafter(good, tmp_path / "head", layout="aws")
    real = drafter_io._write_tensors

    def crashing(tensors, file):
        real(tensors, file)
        with open(file, "r+b") as fh:  # half-written file, then the "crash"
            fh.truncate(file.stat().st_size // 2)
        raise OSError("disk full")

    monkeypatch.setattr(drafter_io, "_write_tensors", crashing)
    with pytest.raises(OSError, match="disk full"):
        save_drafter(_make(target_cfg, peagle=True, seed=1), dest, layout="aws")
    with pytest.raises(OSError, match="disk full"):
        save_drafter(good, tmp_path / "fresh", layout="aws")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]  # no temp dirs, no partial "fresh"
    _assert_same_params(good, load_drafter(dest))

    monkeypatch.setattr(drafter_io, "_write_tensors", real)  # a later save replaces it
    other = _make(target_cfg, peagle=True, seed=1)
    save_drafter(other, dest, layout="speculators")
    _assert_same_params(other, load_drafter(dest))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]


def test_refuses_to_replace_foreign_directory(tmp_path, target_cfg):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "tokenizer.json").write_text("{}")
    with pytest.raises(FileExistsError, match="tokenizer.json"):
        save_drafter(_make(target_cfg, peagle=False), tmp_path / "dir")
    assert (tmp_path / "dir" / "tokenizer.json").exists()


def test_bf16_save_loads(tmp_path, target_cfg):
    d = _make(target_cfg, peagle=True)
    path = save_drafter(d, tmp_path / "bf16", layout="speculators", dtype="bfloat16")
    keys = _keys(path)
    assert keys["fc.weight"][0] == "bfloat16" and keys["mask_hidden"][0] == "bfloat16"
    assert keys["d2t"][0] == "int64" and keys["t2d"][0] == "bool"

    loaded = load_drafter(path)  # float32 model from bf16 weights: exactly the rounded values
    for k, p in param_paths(d).items():
        want = np.asarray(p[...]).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(param_paths(loaded)[k][...]), want, err_msg=k)

    lb = load_drafter(path, dtype="bfloat16")
    assert lb.config.dtype == "bfloat16"
    assert all(p[...].dtype == jnp.bfloat16 for p in param_paths(lb).values())
    (o32, _), (o16, _) = _forward(loaded), _forward(lb)
    assert o16.logits.shape == o32.logits.shape and np.isfinite(np.asarray(o16.logits)).all()
    np.testing.assert_allclose(np.asarray(o16.logits), np.asarray(o32.logits), atol=0.5, rtol=0.1)


def test_large_head_is_written_as_hf_shards(tmp_path, target_cfg):
    # Past max_shard_bytes the weights become model-0000i-of-0000n.safetensors + an HF index
    # (a tensor larger than the limit gets a shard alone); loading reads them as one file.
    d = _make(target_cfg, peagle=True)
    path = save_drafter(d, tmp_path / "head", layout="aws", target_config=target_cfg, max_shard_bytes=4096)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (path / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards
    assert all(name.endswith(f"-of-{len(shards):05d}.safetensors") for name in shards)
    sizes = {}
    for name in shards:
        with safe_open(str(path / name), framework="numpy") as fh:
            sizes[name] = [fh.get_tensor(k).nbytes for k in fh.keys()]
    assert all(sum(s) <= 4096 or len(s) == 1 for s in sizes.values())
    assert index["metadata"]["total_size"] == sum(map(sum, sizes.values()))
    assert drafter_io.tensor_names(path) == set(index["weight_map"])
    _assert_same_params(d, load_drafter(path))
    # a later single-file save replaces the sharded directory (its files are ours, not foreign)
    save_drafter(d, path, layout="aws", target_config=target_cfg)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]

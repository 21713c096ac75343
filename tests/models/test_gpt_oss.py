"""GPT-OSS beyond the logits parity of test_parity_hf.py: MXFP4 expert checkpoints, the MoE
paths with GPT-OSS's router and biased clamped-SwiGLU experts, and speculative decoding through
`peagle_jax.load` with a head in the AWS P-EAGLE layout made for it (4 layers, llama3 RoPE, the
full vocabulary)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import slow_except
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from peagle_jax import load  # noqa: E402
from peagle_jax.checkpoints import load_target  # noqa: E402
from peagle_jax.checkpoints.drafter_io import save_drafter  # noqa: E402
from peagle_jax.checkpoints.gpt_oss import dequantize_mxfp4  # noqa: E402
from peagle_jax.checkpoints.params import CheckpointError  # noqa: E402
from peagle_jax.drafters import DrafterConfig, create_drafter  # noqa: E402
from peagle_jax.models import create_model  # noqa: E402
from peagle_jax.models.config import ModelConfig  # noqa: E402
from peagle_jax.models.layer_stack import stack_blocker  # noqa: E402
from peagle_jax.pytree_paths import param_paths  # noqa: E402

LLAMA3_ROPE = tuple(sorted(dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=16).items()))


def _mxfp4(rng, experts: int, rows: int, cols: int):
    """Random MXFP4 blocks [E, rows, cols/32, 16] and scales near 2^0 (127 is 2^0)."""
    blocks = rng.integers(0, 256, size=(experts, rows, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(122, 131, size=(experts, rows, cols // 32), dtype=np.uint8)
    return blocks, scales


def test_mxfp4_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _mxfp4(np.random.default_rng(0), 3, 8, 64)
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), ref.numpy())
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks, scales[..., :1])


@pytest.fixture(scope="module")
def tiny_hf_dirs(make_tiny_hf, tmp_path_factory):
    """(the tiny GPT-OSS saved as transformers writes it, the same weights with MXFP4 experts)."""
    from safetensors.numpy import load_file, save_file

    hf = make_tiny_hf("gpt_oss", seed=7)
    cfg = hf.config
    rng = np.random.default_rng(1)
    quantized = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            experts = layer.mlp.experts
            for name, rows, cols in (("gate_up_proj", 2 * cfg.intermediate_size, cfg.hidden_size),
                                     ("down_proj", cfg.hidden_size, cfg.intermediate_size)):
                blocks, scales = _mxfp4(rng, cfg.num_local_experts, rows, cols)
                getattr(experts, name).copy_(torch.from_numpy(dequantize_mxfp4(blocks, scales)) * 0.25)
                quantized[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
                quantized[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales - 2  # the 0.25
    plain = tmp_path_factory.mktemp("gpt_oss_plain")
    hf.save_pretrained(plain)
    _word_tokenizer(cfg.vocab_size).save(str(plain / "tokenizer.json"))  # `load` reads one beside the weights
    mxfp4 = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    (mxfp4 / "config.json").write_text((plain / "config.json").read_text())
    tensors = {k: v for k, v in load_file(plain / "model.safetensors").items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file(tensors | quantized, mxfp4 / "model.safetensors")
    return plain, mxfp4


def _word_tokenizer(vocab_size: int):
    """A word-level tokenizer whose ids are the tiny model's whole vocabulary ("w0" .. "wN")."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_mxfp4_checkpoint_loads_as_its_dequantized_weights(tiny_hf_dirs, tmp_path):
    from safetensors.numpy import load_file, save_file

    plain, mxfp4 = tiny_hf_dirs
    a, b = param_paths(load_target(plain)), param_paths(load_target(mxfp4))
    assert a.keys() == b.keys()
    for path in a:
        np.testing.assert_array_equal(np.asarray(a[path][...]), np.asarray(b[path][...]), err_msg=path)
    # blocks without their scales: an error naming the missing tensor
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((mxfp4 / "config.json").read_text())
    tensors = load_file(mxfp4 / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.down_proj_scales"):
        load_target(broken)


def _tiny_oss_config(**changes) -> ModelConfig:
    return ModelConfig(architecture="gpt_oss", vocab_size=64, hidden_size=32, intermediate_size=16,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, moe_router="topk_softmax",
                       moe_bias=True, swiglu_limit=1.0, attention_sinks=True, sliding_window=4,
                       sliding_layers=(0,)).replace(**changes)


@pytest.mark.parametrize("impl", ["gathered", "grouped"])
def test_moe_paths_match_dense(impl):
    import jax
    import jax.numpy as jnp

    cfg = _tiny_oss_config()
    dense = create_model(cfg, seed=2)
    for path, p in param_paths(dense).items():  # the zero-initialised biases too
        if path.endswith(("_bias", "gate.bias")):
            p.value = 0.3 * jax.random.normal(jax.random.key(len(path)), p.value.shape)
    moe_d = dense.layers[0].mlp
    moe_o = nnx.clone(moe_d)
    moe_o.impl = impl
    rng = np.random.default_rng(3)
    for shape in ((1, 1), (1, 4), (3, 5)):  # a decode row, a verify's rows, rows sharing experts
        x = jnp.asarray(rng.normal(size=(*shape, cfg.hidden_size)), jnp.float32)
        np.testing.assert_allclose(np.asarray(moe_o(x)), np.asarray(moe_d(x)), rtol=1e-5, atol=1e-5)


def test_alternating_windows_scan_as_unrolled():
    """Sliding and full layers hold their windows as data, so they stack: the scanned forward
    gives the unrolled one's logits (float32), prefill and decode steps past the window."""
    import jax.numpy as jnp

    from peagle_jax.models.layer_stack import stack_layers

    cfg = _tiny_oss_config(num_hidden_layers=4, sliding_layers=(0, 2))
    unrolled, scanned = create_model(cfg, seed=6), create_model(cfg, seed=6)
    assert stack_blocker(scanned) is None
    stack_layers(scanned)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 14)), jnp.int32)
    caches = [m.init_cache(2, 32) for m in (unrolled, scanned)]
    for lo, hi in ((0, 9), (9, 10), (10, 14)):
        pos = jnp.broadcast_to(jnp.arange(lo, hi), (2, hi - lo))
        outs = [m(tokens[:, lo:hi], pos, c) for m, c in zip((unrolled, scanned), caches, strict=True)]
        caches = [o.cache for o in outs]
        np.testing.assert_allclose(np.asarray(outs[1].logits), np.asarray(outs[0].logits), rtol=1e-5, atol=1e-5)


# bf16 (the CPU kernels) in the fast suite; float32 (XLA) is covered there by the other models' tests
@pytest.mark.parametrize("dtype", slow_except(["float32", "bfloat16"], fast={"bfloat16"}, one_argument=True))
def test_speculative_equals_plain_with_an_aws_layout_head(tiny_hf_dirs, tmp_path, dtype):
    """A GPT-OSS-style P-EAGLE head (4 layers, llama3 RoPE, draft vocabulary = the target's, no
    d2t) saved in the AWS layout, loaded by `load` beside the target: greedy P-EAGLE, EAGLE-3-style
    drafting by the same head and prompt lookup all give plain decoding's tokens."""
    plain_dir, _ = tiny_hf_dirs
    target = load_target(plain_dir)
    vocab = target.config.vocab_size
    cfg = DrafterConfig.for_target(target.config, num_layers=4, parallel_drafting=True, mask_token_id=vocab - 1,
                                   draft_vocab_size=vocab, rope_scaling=LLAMA3_ROPE, num_depths=4)
    head_dir = save_drafter(create_drafter(cfg, seed=5), tmp_path / "head", layout="aws",
                            target_config=target.config)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(head_dir / "model.safetensors")
    tensors.pop("d2t", None), tensors.pop("t2d", None)  # AWS's GPT-OSS heads ship no vocabulary maps
    save_file(tensors, head_dir / "model.safetensors")
    prompts = [[3, 9, 27, 17, 3, 9, 27, 17, 3, 9], [5, 6, 7, 8, 40, 41, 42, 5, 6, 7, 8]]
    kw = dict(max_new_tokens=24, eos_token_ids=[])
    plain = load(str(plain_dir), method="none", dtype=dtype).generate(prompts, **kw).tokens
    llm = load(str(plain_dir), drafter=str(head_dir), method="peagle", num_draft_tokens=3, dtype=dtype)
    assert llm.drafter.config.num_hidden_layers == 4 and llm.drafter.config.draft_vocab_size == target.config.vocab_size
    assert llm.options["layer_loop"] == "scan"
    assert llm.generate(prompts, **kw).tokens == plain
    assert load(str(plain_dir), method="ngram", num_draft_tokens=3, dtype=dtype).generate(prompts, **kw).tokens == plain


@pytest.mark.parametrize("with_sinks", [True, False])
def test_reference_attention_sinks_and_window(with_sinks):
    """The blocked reference against a dense softmax over [keys in the window, the sink]: rows
    whose whole first key blocks lie outside the window, with and without sinks."""
    import jax.numpy as jnp

    from kernels_pallas.cache_attention import cache_attention_reference

    rng = np.random.default_rng(4)
    b, t, h, kvh, d, s, window = 2, 3, 4, 2, 8, 32, 5
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    k, v = (rng.normal(size=(b, kvh, s, d)).astype(np.float32) for _ in range(2))
    pos = np.array([[28, 29, 30], [3, 17, 31]], np.int32)
    sinks = rng.normal(size=(h,)).astype(np.float32) if with_sinks else None
    out = cache_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos),
                                    sinks=None if sinks is None else jnp.asarray(sinks), window=window, key_block=8)
    scores = np.einsum("bthd,bhsd->bths", q, np.repeat(k, h // kvh, axis=1)) / np.sqrt(d)
    keys = np.arange(s)
    seen = (keys <= pos[..., None]) & (keys > pos[..., None] - window)  # [B, T, S]
    scores = np.where(seen[:, :, None], scores, -np.inf)
    if sinks is not None:
        scores = np.concatenate([scores, np.broadcast_to(sinks[:, None], (b, t, h, 1))], axis=-1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True))[..., :s]
    ref = np.einsum("bths,bhsd->bthd", p, np.repeat(v, h // kvh, axis=1))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)

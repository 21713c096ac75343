"""A target's weights in their GGUF quantization on the CPU kernel (gemv_group.cc): every block
format parsed exactly as `gguf.quants.dequantize` reads it, the kernel's product against the
dequantized weights, and a row's bits the same whatever the number of rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

import kernels_cpu
from peagle_jax.checkpoints.gguf_blocks import GROUP_TYPES, group_weights

needs_kernel = pytest.mark.skipif(not kernels_cpu.available(),
                                  reason=f"CPU kernel unavailable: {kernels_cpu.unavailable_reason()}")


def random_blocks(qtype: T, rows: int, cols: int, rng) -> np.ndarray:
    """A [rows, cols] tensor of `qtype` as GGUF stores it: random bytes (every pattern is a valid
    block) with each float16 field set to a small finite number."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
    halves = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q8_0: [0], T.Q5_0: [0], T.Q6_K: [208]}[qtype]
    for at in halves:
        b[:, at:at + 2] = (rng.uniform(-0.02, 0.02, len(b)).astype(np.float16)).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("name", GROUP_TYPES)
def test_blocks_parse_to_gguf_dequantize_exactly(name):
    rng = np.random.default_rng(1)
    qtype = T[name]
    data = random_blocks(qtype, 64, 512, rng)
    gw = group_weights(data, qtype, 64, 512)
    reference = dequantize(data, qtype).reshape(64, 512).T  # [in, out]
    np.testing.assert_allclose(gw.dequantize(), reference, rtol=0, atol=2e-7 * np.abs(reference).max())
    order = rng.permutation(64)
    permuted = group_weights(data, qtype, 64, 512, row_order=order)
    np.testing.assert_array_equal(permuted.dequantize(), gw.dequantize()[:, order])


def test_unsupported_types_and_bad_sizes():
    assert group_weights(np.zeros((4, 64), np.float32), T.F32, 4, 64) is None
    assert group_weights(np.zeros((4, 44), np.uint8), T.Q5_1, 4, 64) is None
    with pytest.raises(ValueError, match="does not hold"):
        group_weights(np.zeros((4, 36), np.uint8), T.Q4_0, 4, 96)


@needs_kernel
@pytest.mark.parametrize("name", GROUP_TYPES)
def test_kernel_is_the_dequantized_product_and_row_invariant(name):
    rng = np.random.default_rng(2)
    qtype = T[name]
    out, inp = 96, 512
    gw = group_weights(random_blocks(qtype, out, inp, rng), qtype, out, inp)
    pack = kernels_cpu.pack_g4 if gw.format == "g4" else kernels_cpu.pack_g8
    packed = jnp.asarray(pack(gw.q, gw.scale, gw.min) if gw.format == "g4" else pack(gw.q, gw.scale))
    w = gw.dequantize()
    np.testing.assert_array_equal(np.asarray(kernels_cpu.unpack_group(packed)), w)
    x = rng.standard_normal((7, inp))
    x[0, :64] = 0.0  # an all-zero group
    x[1] *= 1e3  # rows far from 1, and groups spanning many powers of two
    x[2, 32:96] *= np.logspace(-6, 2, 64)
    x = jnp.asarray(x, jnp.bfloat16)
    y = np.asarray(kernels_cpu.matmul(x, packed))
    reference = np.asarray(x, np.float64) @ w.astype(np.float64)
    # the kernel rounds each row's values at 2^-14 of its group's largest (gemv_group.cc): far
    # below the 2^-8 at which the activations are bf16 in the first place
    error = np.abs(y - reference) / np.abs(reference).max(axis=1, keepdims=True)
    assert error.max() < 5e-4, error.max(axis=1)
    for rows in range(1, 7):
        np.testing.assert_array_equal(np.asarray(kernels_cpu.matmul(x[:rows], packed)), y[:rows])
    # many rows (AMX hosts sum them on integer tiles: blocks of 16, chunks of 256) give each row
    # the bits it has alone (one row always runs the AVX2 loop)
    many = np.asarray(kernels_cpu.matmul(jnp.tile(x, (43, 1)), packed))
    np.testing.assert_array_equal(many, np.tile(y, (43, 1)))
    bf16 = np.asarray(kernels_cpu.matmul(x, packed, jnp.bfloat16))
    np.testing.assert_array_equal(bf16, np.asarray(jnp.asarray(y).astype(jnp.bfloat16)))


def test_packers_reject_shapes_they_cannot_tile():
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels_cpu.pack_g4(np.zeros((64, 40), np.uint8), np.zeros((2, 40), np.float32), np.zeros((2, 40), np.float32))
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels_cpu.pack_g8(np.zeros((24, 32), np.int8), np.zeros((1, 32), np.float32))


@pytest.mark.parametrize(("fmt", "group", "levels"), [("g4", 32, 15), ("g8", 16, 254)])
def test_a_float_weight_quantized_into_groups_rounds_each_to_its_nearest_level(fmt, group, levels):
    # A draft head's bf16 weights go to the group kernel as g4 Linears / a g8 lm_head (draft_weights="g4").
    rng = np.random.default_rng(3)
    w = rng.standard_normal((96, 64)).astype(np.float32) * np.logspace(-3, 0, 64, dtype=np.float32)
    w[:group, 5] = 0.25  # a constant group: its one level is exact
    back = np.asarray(kernels_cpu.unpack_group(jnp.asarray(kernels_cpu.quantize_group(w, fmt))))
    g = w.reshape(-1, group, 64)
    step = (g.max(axis=1) - g.min(axis=1) if fmt == "g4" else 2 * np.abs(g).max(axis=1)) / levels
    error = np.abs(back - w).reshape(g.shape)
    assert np.all(error <= step[:, None] * 0.5 * (1 + 1e-4) + 1e-7), (error / step[:, None]).max()
    assert back[0, 5] == np.float32(0.25)
    with pytest.raises(ValueError, match=f"input width a multiple of {group}"):
        kernels_cpu.quantize_group(np.zeros((group + 8, 32), np.float32), fmt)
    with pytest.raises(ValueError, match="'g4' or 'g8'"):
        kernels_cpu.quantize_group(w, "q4")


# Layer 0 in 4-bit blocks but its down projection in Q6_K, layer 1 mixed (q / k 4-bit with v
# 8-bit: no fused q/k/v call), the embedding or lm_head in Q8_0; norms stay F32.
_TYPES = {r"blk\.0\.(attn_[qkv]|attn_output|ffn_gate|ffn_up)\.weight": T.Q4_0,
          r"blk\.0\.ffn_down\.weight": T.Q6_K,
          r"blk\.1\.(attn_[qk]|attn_output|ffn_gate|ffn_up)\.weight": T.Q4_1,
          r"blk\.1\.attn_v\.weight": T.Q8_0, r"blk\.1\.ffn_down\.weight": T.Q5_0,
          r"(token_embd|output)\.weight": T.Q8_0}


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_quantized_gguf_target_runs_on_its_own_blocks(make_tiny_hf, tmp_path, arch):
    """Every Linear and the lm_head packed from the file (llama: tied, q/k un-permuted; qwen2:
    biases); logits close to the float32 dequantized model's; speculative output equals plain."""
    from conftest import write_gguf

    from benchmarks.weights_quality import teacher_forced_logits
    from peagle_jax.api import LoadedModel
    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.gguf_loader import load_gguf_model_with_blocks
    from peagle_jax.drafters.ngram import NgramProposer
    from peagle_jax.models.options import choose_matmul, configure_inference

    hf = make_tiny_hf(arch, intermediate_size=256, num_hidden_layers=2, tie_word_embeddings=arch == "llama")
    path = tmp_path / "m.gguf"
    write_gguf(hf, path, types=_TYPES)
    target, found = load_gguf_model_with_blocks(path)
    assert {k: v.format for k, v in found.items()} == {
        **{f"layers.0.{m}": "g4" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")},
        "layers.0.mlp.down_proj": "g8",
        **{f"layers.1.{m}": "g4" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj",
                                          "mlp.gate_proj", "mlp.up_proj")},
        "layers.1.self_attn.v_proj": "g8", "layers.1.mlp.down_proj": "g8",
        "embed_tokens" if arch == "llama" else "lm_head": "g8"}

    assert target.lm_head is None if arch == "qwen2" else target.embed_tokens is not None
    assert target.layers[1].mlp.down_proj.kernel is None  # never dequantized
    assert choose_matmul(target, "auto", file_weights=found) == "cpu_kernel"
    configure_inference(target, attention="cpu")
    layer0, layer1 = target.layers[0], target.layers[1]
    assert layer0.self_attn.qkv_packed[...].shape[-1] == kernels_cpu.G4_RECORD  # one fused call
    assert layer1.self_attn.qkv_packed is None  # mixed formats: a call each
    assert layer1.self_attn.v_proj.kernel_packed[...].shape[-1] == kernels_cpu.G8_RECORD
    assert layer0.mlp.down_proj.kernel_packed[...].shape[-1] == kernels_cpu.G8_RECORD
    assert target.lm_head_packed[...].shape[-1] == kernels_cpu.G8_RECORD

    reference = load_target(path, dtype="float32")
    tokens = list(range(3, 40))
    ours = teacher_forced_logits(LoadedModel.from_target(target), tokens)
    ref = teacher_forced_logits(LoadedModel.from_target(reference), tokens)
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()  # bf16 activations, the file's weights

    plain = LoadedModel.from_target(target).generate([tokens[:12]], max_new_tokens=24).tokens[0]
    lookup = LoadedModel.from_target(target, drafter=NgramProposer(2, 4), method="ngram").generate(
        [tokens[:12]], max_new_tokens=24, num_draft_tokens=3).tokens[0]
    assert list(lookup) == list(plain)


def test_target_weights_file_names_what_it_needs(tmp_path):
    from peagle_jax.api import _file_weights_blocker
    from peagle_jax.options import Options

    with pytest.raises(ValueError, match="target_weights 'file' runs on the CPU matmul kernel"):
        Options(target_weights="file", dtype="float32")
    assert "not a GGUF file" in _file_weights_blocker(Options(), tmp_path / "hf", None)
    assert "matmul auto or cpu_kernel" in _file_weights_blocker(Options(matmul="xla"), tmp_path / "m.gguf", None)


def test_the_test_files_q6_k_quantizer_round_trips():
    from conftest import quantize_q6_k

    w = np.random.default_rng(3).standard_normal((8, 512)).astype(np.float32)
    back = dequantize(quantize_q6_k(w), T.Q6_K).reshape(w.shape)
    step = np.abs(w.reshape(-1, 16)).max(axis=1, keepdims=True) / 31.0
    assert (np.abs(back - w).reshape(-1, 16) <= 0.6 * step + 1e-3).all()

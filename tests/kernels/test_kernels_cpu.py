"""The row-invariant CPU matmul kernel (kernels_cpu) and its wiring (models.options.choose_matmul).

The kernel must (1) compute x @ w to float32 accuracy, (2) give every row the same bits
whatever the number of rows in the call, which is what keeps speculative decoding exact, and
(3) leave a model's greedy tokens those of plain decoding when it serves target and head.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import slow_except
from flax import nnx

import kernels_cpu
from peagle_jax.drafters import DrafterConfig, create_drafter
from peagle_jax.generate import speculative_generate
from peagle_jax.models import ModelConfig, create_model
from peagle_jax.models.layers import (
    KERNEL_MAX_ROWS,
    MLP,
    Attention,
    Linear,
    PackedKernel,
    fused_linears,
    kernel_max_rows,
    matmul,
    packed_matmul,
)
from peagle_jax.models.options import choose_matmul, cpu_kernel_blocker, pack_cpu_matmuls

needs_kernel = pytest.mark.skipif(not kernels_cpu.available(),
                                  reason=f"kernels_cpu unavailable: {kernels_cpu.unavailable_reason()}")


def _bf16(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17])
@pytest.mark.parametrize(("d_in", "d_out"), [(64, 32), (576, 192), (96, 1024)])
def test_matmul_matches_float64_reference(rows, d_in, d_out):
    rng = np.random.default_rng(rows * d_out)
    x, w = _bf16(rng, (rows, d_in)), _bf16(rng, (d_in, d_out), d_in ** -0.5)
    got = np.asarray(jax.jit(kernels_cpu.matmul)(x, kernels_cpu.pack(w)))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert got.dtype == np.float32 and got.shape == (rows, d_out)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@needs_kernel
def test_rows_are_bitwise_invariant_to_row_count():
    """Row r's bits do not depend on the rows beside it: 1 row alone, or among 2-69 others
    (past 64 rows the kernel runs the rows in two groups over each tile)."""
    rng = np.random.default_rng(0)
    x, w = _bf16(rng, (70, 576)), kernels_cpu.pack(_bf16(rng, (576, 1536), 0.04))
    call = jax.jit(kernels_cpu.matmul)
    full = np.asarray(call(x, w))
    for rows in (1, 2, 3, 4, 5, 8, 14, 15, 16, 32, 33, 64):
        part = np.asarray(call(x[:rows], w))
        assert np.array_equal(part, full[:rows]), f"rows of a {rows}-row call differ from a 70-row call"
    assert np.array_equal(np.asarray(call(x[64:], w)), full[64:]), "the second group of rows differs"
    # Leading axes are rows too ([B, T, I], as in a batched verify).
    assert np.array_equal(np.asarray(call(x[:32].reshape(4, 8, 576), w)).reshape(32, -1), full[:32])


_ROW0_SCRIPT = """
import sys, numpy as np, jax.numpy as jnp, kernels_cpu
assert kernels_cpu.available(), kernels_cpu.unavailable_reason()
rng = np.random.default_rng(0)
rows = []
# Ordinary values, then magnitudes spread over 2^-60..2^60 (sums that overflow, products that
# vanish), then bf16 denormals (flushed to zero by every set).
for spread, tiny in ((0, False), (60, False), (0, True)):
    scale = lambda shape: 2.0 ** rng.integers(-spread, spread + 1, shape) * (1e-39 if tiny else 1.0)
    x = jnp.asarray(rng.standard_normal((40, 576)) * scale((40, 576)), jnp.bfloat16)
    w = kernels_cpu.pack(jnp.asarray(rng.standard_normal((576, 1536)) * 0.04 * scale((576, 1536)), jnp.bfloat16))
    rows += [np.asarray(kernels_cpu.matmul(x[:m], w))[0] for m in (1, 2, 3, 8, 14, 15, 40)]
np.save(sys.argv[1], np.stack(rows))
print(kernels_cpu.instruction_set())
"""


@needs_kernel
@pytest.mark.skipif("avx512f" not in kernels_cpu.cpu_flags(), reason="this CPU runs the AVX2 loops only")
def test_non_amx_loop_sets_give_the_same_bits(tmp_path):
    """The AVX512-BF16 dot products (every row count), the AVX-512F FMAs (3+ rows) and the AVX2
    FMAs give bitwise the same sums (same order per element), so a model's tokens do not depend
    on which of them a host has. (AMX, where present, rounds its own way; here it is turned
    off.) The library picks its loops once per process, so each set runs in a fresh one."""
    import os
    import subprocess
    import sys

    rows0 = {}
    for extra_env in ({}, {"PEAGLE_CPU_KERNEL_NO_DPBF16": "1"}, {"PEAGLE_CPU_KERNEL_AVX2": "1"}):
        out = tmp_path / f"{len(rows0)}.npy"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PEAGLE_CPU_KERNEL_")} | extra_env
        env["PEAGLE_CPU_KERNEL_NO_AMX"] = "1"
        done = subprocess.run([sys.executable, "-c", _ROW0_SCRIPT, str(out)], check=True, env=env, timeout=300,
                              capture_output=True, text=True)
        rows0[done.stdout.split()[-1]] = np.load(out).view(np.uint32)
    assert "avx2" in rows0 and len(rows0) >= 2, rows0.keys()
    for loops, bits in rows0.items():
        assert np.array_equal(bits, rows0["avx2"]), f"the {loops} loops round differently from the AVX2 ones"


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_bf16_result_is_the_float32_result_rounded(rows):
    """out_dtype=bfloat16 rounds in the kernel: the bits of XLA converting the float32 result,
    ties to even included (weights with few significant bits make exact ties common)."""
    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.integers(-8, 9, (96, 64)) / 8.0, jnp.bfloat16)
    x = jnp.asarray(rng.integers(-64, 65, (rows, 96)) * 2.0 ** rng.integers(-20, 20, (rows, 1)), jnp.bfloat16)
    packed = kernels_cpu.pack(w)
    want = np.asarray(kernels_cpu.matmul(x, packed).astype(jnp.bfloat16))
    got = kernels_cpu.matmul(x, packed, out_dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))
    with pytest.raises(ValueError, match="out_dtype"):
        kernels_cpu.matmul(x, packed, out_dtype=jnp.float16)


def test_pack_layout_and_bad_width():
    w = jnp.arange(5 * 64, dtype=jnp.float32).reshape(5, 64)
    packed = kernels_cpu.pack(w)
    assert packed.shape == (2, 16, 64) and packed.dtype == jnp.bfloat16  # 3 input pairs, padded to 16
    # tile 1, pair 1: columns 32-63, each column's inputs 2 and 3 side by side
    want = np.stack([np.asarray(w[2, 32:]), np.asarray(w[3, 32:])], axis=1).reshape(-1)
    assert np.array_equal(np.asarray(packed[1, 1], np.float32), want)
    # pair 2 holds input 4 and a zero; pairs 3-15 are zero
    assert np.array_equal(np.asarray(packed[0, 2, 1::2], np.float32), np.zeros(32))
    assert not np.any(np.asarray(packed[:, 3:], np.float32))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        kernels_cpu.pack(jnp.zeros((4, 48), jnp.bfloat16))


@needs_kernel
def test_long_calls_follow_the_row_limit():
    """Without AMX, prefill-sized calls (more than KERNEL_MAX_ROWS rows per sequence) go through
    `matmul`; with AMX every call goes to the kernel."""
    rng = np.random.default_rng(1)
    w = _bf16(rng, (64, 64), 0.1)
    packed = PackedKernel(kernels_cpu.pack(w))
    long_x = _bf16(rng, (1, KERNEL_MAX_ROWS + 1, 64))
    kernel_long = np.asarray(kernels_cpu.matmul(long_x, packed[...]).astype(jnp.bfloat16))
    want_long = kernel_long if kernels_cpu.instruction_set() == "amx" else np.asarray(matmul(long_x, w))
    assert kernel_max_rows() == (None if kernels_cpu.instruction_set() == "amx" else KERNEL_MAX_ROWS)
    assert np.array_equal(np.asarray(packed_matmul(long_x, packed, w)), want_long)
    short_x = long_x[:, :KERNEL_MAX_ROWS]
    got = packed_matmul(short_x, packed, w)
    assert got.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(got), np.asarray(kernels_cpu.matmul(short_x, packed[...]).astype(jnp.bfloat16)))


@needs_kernel
def test_fused_call_gives_each_linear_its_own_bits():
    """q/k/v (with biases, as in Qwen2) in one call: each output bitwise its own packed call."""
    rngs = nnx.Rngs(0)
    linears = tuple(Linear(64, d, bias=True, dtype=jnp.bfloat16, rngs=rngs) for d in (128, 32, 32))
    for lin in linears:
        lin.bias.value = _bf16(np.random.default_rng(lin.kernel.shape[1]), (lin.kernel.shape[1],))
    fused = PackedKernel(jnp.concatenate([kernels_cpu.pack(lin.kernel[...]) for lin in linears], axis=0))
    x = _bf16(np.random.default_rng(2), (2, 3, 64))
    separate = [packed_matmul(x, PackedKernel(kernels_cpu.pack(lin.kernel[...])), lin.kernel[...]) + lin.bias[...]
                for lin in linears]
    for got, want in zip(fused_linears(x, fused, linears), separate, strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want))
    plain = fused_linears(x, None, linears)  # no packed weights: each Linear on XLA
    for got, lin in zip(plain, linears, strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(lin(x)))


def _pair(dtype="bfloat16"):
    cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, dtype=dtype)
    target = create_model(cfg, 3)
    drafter = create_drafter(
        DrafterConfig.for_target(cfg, num_layers=1, parallel_drafting=True, mask_token_id=127), 4)
    return target, drafter


def _packed_count(module):
    return sum(1 for _, v in nnx.iter_graph(module) if isinstance(v, PackedKernel))


def test_choose_matmul_paths_and_errors():
    target, _ = _pair("float32")
    assert cpu_kernel_blocker(target) == "the weights are not bfloat16"
    assert choose_matmul(target, "auto") == "xla" and _packed_count(target) == 0
    with pytest.raises(ValueError, match="not bfloat16"):
        choose_matmul(target, "cpu_kernel")
    with pytest.raises(ValueError, match="unknown matmul"):
        choose_matmul(target, "fast")
    bf16, _ = _pair()
    assert choose_matmul(bf16, "xla") == "xla" and _packed_count(bf16) == 0


@pytest.mark.slow
@needs_kernel
def test_packed_model_and_head_decode_like_plain():
    """Target and head both on the kernel: every Linear and both lm_heads packed; greedy
    speculative tokens equal plain greedy tokens of the same packed model, and the packed
    model's logits stay within bf16 rounding of XLA's."""
    target, drafter = _pair()
    tokens = jnp.asarray([[5, 9, 17, 33, 2, 8]])
    positions = jnp.arange(6)[None]
    ref = target(tokens, positions, target.init_cache(1, 32)).logits
    assert choose_matmul(target, "auto") == "cpu_kernel"
    pack_cpu_matmuls(drafter)
    for module in (target, drafter):
        for _, node in nnx.iter_graph(module):
            if isinstance(node, Attention):
                assert node.qkv_packed is not None and node.o_proj.kernel_packed is not None
                assert node.q_proj.kernel_packed is None  # served by the fused call
            if isinstance(node, MLP):
                assert node.gate_up_packed is not None and node.down_proj.kernel_packed is not None
        assert module.lm_head_packed is not None
    got = target(tokens, positions, target.init_cache(1, 32)).logits
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=0.05 * float(jnp.abs(ref).max()))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
    plain = speculative_generate(target, None, prompts, method="none", max_new_tokens=12)
    for method in ("peagle", "eagle3"):
        for k in (1, 3, 7):
            spec = speculative_generate(target, drafter, prompts, method=method, num_draft_tokens=k,
                                        max_new_tokens=12)
            assert spec.tokens == plain.tokens, (method, k)


def test_load_rejects_bad_matmul_settings():
    from peagle_jax.api import load

    with pytest.raises(ValueError, match="matmul"):
        load(method="none", matmul="fast")
    with pytest.raises(ValueError, match="drop mesh"):
        load(method="none", matmul="cpu_kernel", mesh="model=2")


# ---- 7-bit and 4-bit weights (kernels_cpu.pack_q7 / pack_q4), for draft heads -------------------

_Q7_SCRIPT = """
import sys, numpy as np, jax.numpy as jnp, kernels_cpu
assert kernels_cpu.available(), kernels_cpu.unavailable_reason()
rng = np.random.default_rng(0)
width, bits = int(sys.argv[1]), sys.argv[2]
pack, unpack = getattr(kernels_cpu, "pack_" + bits), getattr(kernels_cpu, "unpack_" + bits)
x = jnp.asarray(rng.standard_normal((20, width)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((width, 96)) * 0.05, jnp.bfloat16)
packed = pack(w)
ref = np.asarray(x, np.float64) @ np.asarray(unpack(packed, width), np.float64)
full = np.asarray(kernels_cpu.matmul(x, packed))
err = float(np.abs(full - ref).max() / np.abs(ref).max())
invariant = all(np.array_equal(np.asarray(kernels_cpu.matmul(x[:m], packed)), full[:m])
                for m in (1, 2, 3, 14, 15, 16, 17))
print(err, invariant)
"""


_LOOP_ENV = {"default": {}, "no-amx": {"PEAGLE_CPU_KERNEL_NO_AMX": "1"}, "fma": {"PEAGLE_CPU_KERNEL_NO_DPBF16": "1"}}


@needs_kernel
@pytest.mark.parametrize("loops, width, bits", slow_except(
    itertools.product(_LOOP_ENV, [576, 577], ["q7", "q4"]),
    fast={("default", 576, "q7"), ("no-amx", 577, "q4"), ("fma", 577, "q7")}))
def test_quantized_matmul_is_the_dequantized_product_and_row_invariant(loops, width, bits):
    """x @ pack_q7(w) (or pack_q4(w)) equals x times the weights `unpack_q7` (`unpack_q4`) gives
    back, to float32 accuracy (the AMX and dot-product loops' bias of 192 or 136 * sum(x) and the
    FMA loop's 64 or 8 * sum(x) cancel), in every loop the host has (the library picks one per
    process, so each runs in a fresh one; AMX takes widths in whole blocks of 32 inputs, 576, and
    577 the next loop); and a row's result does not depend on the rows beside it, over more than
    one block of 16 rows."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("PEAGLE_CPU_KERNEL_")} | _LOOP_ENV[loops]
    done = subprocess.run([sys.executable, "-c", _Q7_SCRIPT, str(width), bits], check=True, env=env, timeout=300,
                          capture_output=True, text=True)
    err, invariant = done.stdout.split()[-2:]
    assert float(err) < 2e-5, f"{bits} matmul relative error {err}"
    assert invariant == "True", f"a row's {bits} result depends on the number of rows in the call"


def _check_bf16_result_and_width(pack, packed, w, rng):
    """The kernel's bf16 result on `packed` is its float32 result rounded, and `pack` refuses an
    output width that is not a multiple of 32."""
    x = _bf16(rng, (3, w.shape[0]))
    f32 = kernels_cpu.matmul(x, packed)
    assert np.array_equal(np.asarray(kernels_cpu.matmul(x, packed, out_dtype=jnp.bfloat16)),
                          np.asarray(f32.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        pack(w[:, :40])


@needs_kernel
def test_q7_packing_round_trips_to_seven_bit_weights():
    """pack_q7 keeps each column to 7 bits of its own scale (error <= half a step, max |w| / 126),
    and the kernel's bf16 result is its float32 result rounded; a width that is not a multiple of
    32 is refused."""
    rng = np.random.default_rng(3)
    w = _bf16(rng, (64, 64), 0.1) * jnp.asarray(np.linspace(0.01, 3.0, 64), jnp.bfloat16)  # scales per column
    packed = kernels_cpu.pack_q7(w)
    assert packed.dtype == jnp.uint8 and packed.shape == (2, kernels_cpu.Q7_SCALE_ROWS + 32, 64)
    back, exact = np.asarray(kernels_cpu.unpack_q7(packed, 64)), np.asarray(w, np.float32)
    step = np.abs(exact).max(axis=0) / 63
    assert np.all(np.abs(back - exact) <= step / 2 * (1 + 1e-4))
    _check_bf16_result_and_width(kernels_cpu.pack_q7, packed, w, rng)


@needs_kernel
def test_q4_packing_keeps_four_bits_of_the_least_error_clip():
    """pack_q4 keeps each column to 4 bits of its own scale: the scale is a clip of max |w| / 7
    from `Q4_CLIPS`, every weight within the clip is within half a step, none beyond it moves
    inward by more than the clip; the searched clip's squared error is no worse than the absmax
    scale's; the bf16 result is the float32 one rounded; a width not a multiple of 32 is refused."""
    rng = np.random.default_rng(5)
    w = _bf16(rng, (96, 64), 0.1) * jnp.asarray(np.linspace(0.01, 3.0, 64), jnp.bfloat16)
    packed = kernels_cpu.pack_q4(w)
    assert packed.dtype == jnp.uint8 and packed.shape == (2, kernels_cpu.Q4_SCALE_ROWS + 48, 32)
    back, exact = np.asarray(kernels_cpu.unpack_q4(packed, 96)), np.asarray(w, np.float32)
    amax = np.abs(exact).max(axis=0)
    step = np.abs(back).max(axis=0) / 7  # the largest level is +-7 steps: the clip always reaches it
    clips = np.asarray(kernels_cpu.Q4_CLIPS)
    assert np.isclose((step * 7 / amax)[:, None], clips[None, :], rtol=1e-5).any(axis=1).all()
    inside = np.abs(exact) <= 7 * step
    assert np.all(np.abs(back - exact)[inside] <= (step / 2 * (1 + 1e-4) + np.zeros_like(exact))[inside])
    assert np.all(np.abs(back[~inside]) == np.broadcast_to(7 * step, exact.shape)[~inside])
    absmax = np.clip(np.round(exact / (amax / 7)), -7, 7) * (amax / 7)
    assert np.all(((back - exact) ** 2).sum(0) <= ((absmax - exact) ** 2).sum(0) * (1 + 1e-5))
    _check_bf16_result_and_width(kernels_cpu.pack_q4, packed, w, rng)


@needs_kernel
@pytest.mark.parametrize("bits", slow_except(["q7", "q4", "g4"], fast={"g4"}, one_argument=True))
def test_quantized_head_keeps_greedy_tokens_and_drafts_like_bf16(bits):
    """A head with 7-bit weights (or 4-bit Linears beside a 7-bit lm_head, or 4-bit groups beside
    an 8-bit-group lm_head): every packed weight is bytes, greedy speculative tokens are still
    plain decoding's (drafts are verified), and its draft logits stay within the quantization's
    reach of the bf16 head's."""
    from peagle_jax.models.options import draft_weights_for

    target, drafter = _pair()
    assert choose_matmul(target, "auto") == "cpu_kernel"
    quant = pack_cpu_matmuls(nnx.clone(drafter), bits)
    pack_cpu_matmuls(drafter)
    packs = [v[...] for _, v in nnx.iter_graph(quant) if isinstance(v, PackedKernel)]
    assert packs and all(p.dtype == jnp.uint8 for p in packs)
    lm_head_width = kernels_cpu.G8_RECORD if bits == "g4" else 64  # 8-bit groups, else 7 bits
    assert quant.lm_head_packed[...].shape[-1] == lm_head_width
    linears = {"q7": 64, "q4": 32, "g4": kernels_cpu.G4_RECORD}[bits]
    assert {p.shape[-1] for p in packs} == {linears, lm_head_width}
    if bits == "g4":  # the group loop serves every call, prefill too: its packs are the only copy kept
        assert quant.lm_head is None
        assert [path for path, n in nnx.iter_graph(quant) if isinstance(n, Linear) and n.kernel is not None] == []
    prenorm = _bf16(np.random.default_rng(4), (2, drafter.config.hidden_size))
    want, got = drafter.logits_from_prenorm(prenorm), quant.logits_from_prenorm(prenorm)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.05 * float(jnp.abs(want).max()))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    plain = speculative_generate(target, None, prompts, method="none", max_new_tokens=12)
    for method in ("peagle", "eagle3"):
        for k in (1, 3):
            spec = speculative_generate(target, quant, prompts, method=method, num_draft_tokens=k,
                                        max_new_tokens=12)
            assert spec.tokens == plain.tokens, (method, k)
    with pytest.raises(ValueError, match="unknown packed weights"):
        pack_cpu_matmuls(nnx.clone(drafter), "int4")
    assert draft_weights_for("native", "cpu_kernel") == "native"
    assert draft_weights_for("auto", "xla") == "native"
    assert draft_weights_for(bits, "cpu_kernel") == bits
    with pytest.raises(ValueError, match="runs on the CPU matmul kernel"):
        draft_weights_for(bits, "xla")
    with pytest.raises(ValueError, match="draft_weights must be one of"):
        draft_weights_for("int8", "cpu_kernel")


def test_load_rejects_bad_draft_weights():
    from peagle_jax.api import load

    with pytest.raises(ValueError, match="draft_weights"):
        load(draft_weights="int8")
    with pytest.raises(ValueError, match="quantizes a draft head"):
        load(method="ngram", draft_weights="q7")
    with pytest.raises(ValueError, match="needs dtype bfloat16"):
        load(dtype="float32", draft_weights="q7")
    with pytest.raises(ValueError, match="q4.*needs dtype bfloat16"):
        load(dtype="float32", draft_weights="q4")


# ---- SiLU(gate) * up inside the down projection's call (matmul(glu=True)) ------------------------

_GLU_SCRIPT = """
import numpy as np, jax, jax.numpy as jnp, kernels_cpu
from peagle_jax.models.layers import silu
assert kernels_cpu.available(), kernels_cpu.unavailable_reason()
rng = np.random.default_rng(0)
f = 200  # not a multiple of 16: the 8-lane loop and the padded tail run too
gu = jnp.asarray(rng.standard_normal((9, 2 * f)) * 4, jnp.bfloat16)
gu = gu.at[0, :6].set(jnp.asarray([-100.0, -30.0, 0.0, 30.0, 100.0, -0.0], jnp.bfloat16))
eye = kernels_cpu.pack(jnp.eye(f, 32 * 7, dtype=jnp.bfloat16))  # the gated rows themselves
got = np.asarray(kernels_cpu.matmul(gu, eye, jnp.bfloat16, glu=True), np.float32)[:, :f]
want = np.asarray(silu(gu[:, :f]) * gu[:, f:], np.float32)
invariant = all(np.array_equal(np.asarray(kernels_cpu.matmul(gu[:m], eye, jnp.bfloat16, glu=True), np.float32)[:, :f],
                               got[:m]) for m in (1, 2, 5))
print(got.tobytes().hex())
print(int((got != want).sum()), got.size, invariant)
"""


@needs_kernel
def test_glu_matmul_gates_the_rows_in_the_kernel_alike_on_every_vector_width():
    """matmul(glu=True) multiplies bf16(SiLU(gate) * up), the rounding of layers.silu (float32
    SiLU rounded to bf16, then the product): at most 1% of values differ in the last bit (the
    kernel's exp polynomial against XLA's logistic); a row does not depend on the rows beside it;
    the 16-lane and the 8-lane loops (PEAGLE_CPU_KERNEL_AVX2) give the same bits."""
    import os
    import subprocess
    import sys

    outs = []
    for extra in ({}, {"PEAGLE_CPU_KERNEL_AVX2": "1"}):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PEAGLE_CPU_KERNEL_")} | extra
        done = subprocess.run([sys.executable, "-c", _GLU_SCRIPT], check=True, env=env, timeout=300,
                              capture_output=True, text=True)
        bits, counts = done.stdout.split("\n")[-3:-1]
        differ, size, invariant = counts.split()
        assert int(differ) <= 0.01 * int(size), f"{differ} of {size} gated values differ from layers.silu's"
        assert invariant == "True", "a row's gated product depends on the rows beside it"
        outs.append(bits)
    assert outs[0] == outs[1], "the 16-lane and 8-lane SiLU loops give different bits"


@needs_kernel
def test_glu_matmul_rejects_what_it_cannot_gate():
    w = jnp.zeros((64, 32), jnp.bfloat16)
    x = jnp.zeros((2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="glu=True"):
        kernels_cpu.matmul(x, kernels_cpu.pack_q7(w), jnp.bfloat16, glu=True)
    with pytest.raises(ValueError, match="glu=True"):
        kernels_cpu.matmul(x, kernels_cpu.pack(w), jnp.float32, glu=True)
    with pytest.raises(ValueError, match="glu=True"):
        kernels_cpu.matmul(x[:, :127], kernels_cpu.pack(w), jnp.bfloat16, glu=True)


@needs_kernel
def test_a_layer_of_stacked_weights_and_caches_is_read_in_place_alike():
    """The `_layer` custom calls (a scanned target's, layer_view.h) give a layer of a stack the
    bits the plain calls give that layer on its own, and refuse a layer outside the stack."""
    rng = np.random.default_rng(5)
    x = _bf16(rng, (3, 64))
    weights = [_bf16(rng, (64, 96)) for _ in range(3)]
    gated = [_bf16(rng, (64, 64)) for _ in range(3)]
    q = [rng.integers(-127, 127, (64, 96)).astype(np.int8) for _ in range(3)]
    scales = [rng.random((64 // 16, 96)).astype(np.float32) for _ in range(3)]
    stacks = {"bf16": [kernels_cpu.pack(w) for w in weights], "glu": [kernels_cpu.pack(w) for w in gated],
              "g8": [jnp.asarray(kernels_cpu.pack_g8(q[i], scales[i])) for i in range(3)]}
    for name, packs in stacks.items():
        stack = jnp.stack(packs)
        rows = jnp.concatenate([x, x], axis=-1) if name == "glu" else x
        for out in (jnp.float32, jnp.bfloat16):
            if name == "glu" and out == jnp.float32:
                continue
            for i in range(3):
                one = kernels_cpu.matmul(rows, packs[i], out, glu=name == "glu")
                layer = jax.jit(lambda r, s, i, out=out, glu=name == "glu": kernels_cpu.matmul(r, s, out, glu=glu,
                                                                                                 layer=i))
                np.testing.assert_array_equal(np.asarray(layer(rows, stack, jnp.int32(i)), np.float32),
                                              np.asarray(one, np.float32))
    k, v = _bf16(rng, (2, 3, 2, 32, 16)), _bf16(rng, (2, 3, 2, 32, 16))
    queries, positions = _bf16(rng, (2, 3, 4, 16)), jnp.array([[5, 6, 7], [20, 21, 22]], jnp.int32)
    for i in range(3):
        one = kernels_cpu.cache_attention(queries, k[:, i], v[:, i], positions)
        np.testing.assert_array_equal(np.asarray(kernels_cpu.cache_attention(queries, k, v, positions, layer=i),
                                                 np.float32), np.asarray(one, np.float32))
    with pytest.raises(jax.errors.JaxRuntimeError, match="layer index in"):
        jax.block_until_ready(kernels_cpu.matmul(x, jnp.stack(stacks["bf16"]), layer=jnp.int32(3)))
    with pytest.raises(ValueError, match="go with a layer index"):
        kernels_cpu.matmul(x, jnp.stack(stacks["bf16"]))


@needs_kernel
def test_a_scanned_target_on_the_kernels_decodes_like_plain():
    """Packed for the kernels, then stacked (the default on one CPU): within bf16 rounding of
    the unrolled model, with greedy speculation equal to plain greedy decoding."""
    from peagle_jax.models.options import configure_inference

    target, drafter = _pair()
    choose_matmul(target, "cpu_kernel")
    configure_inference(target, attention="cpu")
    tokens, positions = jnp.asarray([[5, 9, 17, 33, 2, 8]]), jnp.arange(6)[None]
    ref = target(tokens, positions, target.init_cache(1, 32)).logits
    configure_inference(target, layer_loop="scan")
    assert target.layer_stack.mlp.gate_up_packed[...].ndim == 4
    got = target(tokens, positions, target.init_cache(1, 32)).logits
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=0.02 * float(jnp.abs(ref).max()))
    pack_cpu_matmuls(drafter)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
    plain = speculative_generate(target, None, prompts, method="none", max_new_tokens=12)
    spec = speculative_generate(target, drafter, prompts, method="peagle", num_draft_tokens=3, max_new_tokens=12)
    assert spec.tokens == plain.tokens

"""Shared fixtures: tiny randomly initialised HF (torch) models used as parity oracles."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

# PEAGLE_TYPECHECK=1 (set by .ci/run): run-time shape/dtype checks of the jaxtyping annotations
# (Float[Array, "B T D"], ...) in our packages, with beartype, installed before any test module
# imports them. Checks run when a function is called eagerly or traced by jit (once per
# compilation), not per executed step. Opt-in because they made tests/generate/test_speculative.py
# about 12-26% slower (wall) on a shared 2-core machine.
if os.environ.get("PEAGLE_TYPECHECK", "0") == "1":
    import sys

    from jaxtyping import install_import_hook

    assert "peagle_jax" not in sys.modules, "imported before the type-check hook: it would check nothing"
    install_import_hook(["peagle_jax", "kernels_pallas"], "beartype.beartype")

# One persistent XLA compilation cache for the whole run: JAX's in-memory caches are dropped after
# every module (`_release_compiled_programs`), and many modules compile the same programs (the same
# tiny models through the same rounds), which the disk cache then loads instead of recompiling.
# A fresh folder per run by default; PEAGLE_TEST_XLA_CACHE=DIR keeps one across local runs
# (the cache key covers the program, the compile options and the jax/XLA versions), =off: none.
def _use_a_compilation_cache() -> None:
    import atexit
    import shutil
    import tempfile

    import jax

    folder = os.environ.get("PEAGLE_TEST_XLA_CACHE")
    if folder == "off":
        return
    if not folder:
        folder = tempfile.mkdtemp(prefix="peagle-test-xla-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_use_a_compilation_cache()


def pytest_configure(config):
    """The fast suite compiles at XLA's backend optimization level 0 (LLVM without its
    optimization passes): its programs are tiny models whose compile time is most of a test's
    cost, and level 0 made them about 1.5x quicker end to end (docs/testing.md). Any run that
    selects slow tests (the real models, the row-invariance checks) compiles as production does,
    and so does PEAGLE_TEST_XLA_OPT=default. Set here, before any test module starts JAX's backend."""
    fast_only = (config.getoption("markexpr") or "").strip() == "not slow"
    flags = os.environ.get("XLA_FLAGS", "")
    if fast_only and os.environ.get("PEAGLE_TEST_XLA_OPT") != "default" and "optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()

# `jax.jit(..., compiler_options=EXECUTION_HEAVY)`: a test program whose run, not its compile,
# is the test's cost (a statistical check over many samples) compiles at XLA:CPU's default
# optimization level, whatever the fast suite's level above.
EXECUTION_HEAVY = {"xla_backend_optimization_level": 3}

# Small but not degenerate: GQA (4 query heads over 2 KV heads). 4 layers keep XLA compiles
# short; pass num_hidden_layers=7 for distinct default EAGLE-3 taps (2, L//2, L-3) = (2, 3, 4).
TINY_COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)


def _randomize(model, seed: int) -> None:
    """Re-draw every weight at O(1) activation scale (HF's std=0.02 init makes logits ~0,
    which would let a 1e-4 tolerance hide real bugs). Norm weights around 1, biases small."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # router: decisive top-k (no near-ties)
                p.copy_(2.0 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif name.endswith("_proj_bias"):  # gpt_oss's expert biases [E, out]
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")) and model.config.model_type == "gpt_oss":
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-2]))  # [E, in, out]
            else:  # [out, in] projections, fused experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


@pytest.fixture(scope="session")
def make_tiny_hf():
    """Factory: make_tiny_hf(arch, seed=0, **config_overrides) -> HF *ForCausalLM (fp32, eval).

    arch is one of "llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss"; attention is "eager".
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }

    def make(arch: str, seed: int = 0, **overrides):
        config_cls, model_cls = classes[arch]
        kw = dict(TINY_COMMON, tie_word_embeddings=False)
        if arch == "qwen3_moe":
            kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        if arch == "gpt_oss":  # experts as wide as intermediate_size; every other layer sees 4 positions
            kw.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=4)
        kw.update(overrides)
        torch.manual_seed(seed)
        config = config_cls(**kw)
        config._attn_implementation = "eager"
        model = model_cls(config).to(torch.float32).eval()
        _randomize(model, seed)
        return model

    return make


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module.

    Every XLA:CPU executable keeps its JIT-compiled code in its own memory mappings, and JAX's
    caches keep every executable alive for the life of the process. Over the whole suite in one
    process that approaches Linux's default limit of 65530 mappings per process
    (vm.max_map_count): at about 18k mappings after a dozen slow tests, the fast suite's
    late compiles crashed inside XLA's compiler (a segfault, then an abort, in two clean-clone CI
    runs, in tests that pass on their own). Clearing the caches between modules frees them; a
    module's own programs are kept while it runs.
    """
    yield
    import jax

    jax.clear_caches()


def slow_except(values, fast, *, one_argument: bool = False) -> list:
    """Parametrize `values` (tuples for several arguments, unless `one_argument`) with those not
    in `fast` marked slow: the fast suite runs a cover (across a test file, each method, K and
    switch at least once), `pytest -m slow` runs the rest of the matrix."""
    out = []
    for value in values:
        args = value if isinstance(value, tuple) and not one_argument else (value,)
        out.append(pytest.param(*args, marks=() if value in fast else pytest.mark.slow))
    return out


TINY_VOCAB = 64  # the vocabulary of `tiny_target`; its last id is `tiny_head`'s mask token


def tiny_target_with_real_tokenizer(*, layers: int, seed: int):
    """(target, tokenizer, eos ids): a random llama target (hidden 32) over the default model's
    tokenizer and vocabulary (49152), so text round trips are real while compiles stay short."""
    from peagle_jax.checkpoints.default_model import default_model_path
    from peagle_jax.checkpoints.tokenizer import eos_token_ids, load_tokenizer
    from peagle_jax.models import ModelConfig, create_model

    tok = load_tokenizer(default_model_path())
    cfg = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=512)
    return create_model(cfg, seed=seed), tok, eos_token_ids(tok)


@pytest.fixture(scope="module")
def tiny_target():
    """A 3-layer random llama target (vocabulary TINY_VOCAB) for step-level tests."""
    from peagle_jax.models import ModelConfig, create_model

    cfg = ModelConfig(architecture="llama", vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return create_model(cfg, seed=1)


@pytest.fixture(scope="module")
def tiny_head(tiny_target):
    """A random 2-layer head for `tiny_target` that drafts both ways (EAGLE-3 and P-EAGLE)."""
    from peagle_jax.drafters import DrafterConfig, create_drafter

    cfg = DrafterConfig.for_target(tiny_target.config, num_layers=2, parallel_drafting=True,
                                   mask_token_id=TINY_VOCAB - 1)
    return create_drafter(cfg, seed=2)


def _gguf_experts(sd: dict, c) -> dict:
    """The GGUF expert stacks (ffn_{gate,up,down}_exps) of an HF MoE state dict, whose experts
    are per-expert tensors or fused (gate_up_proj); empty for a dense model."""
    out = {}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        if f"{p}.gate_up_proj" in sd:
            gate, up = np.split(sd[f"{p}.gate_up_proj"], 2, axis=1)
            down = sd[f"{p}.down_proj"]
        elif f"{p}.0.up_proj.weight" in sd:
            gate, up, down = (np.stack([sd[f"{p}.{e}.{n}_proj.weight"] for e in range(c.num_experts)])
                              for n in ("gate", "up", "down"))
        else:
            continue
        out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = gate, up
        out[f"blk.{i}.ffn_down_exps.weight"] = down
    return out


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Float rows [R, C] -> Q6_K blocks as llama.cpp lays them out ([R, C / 256 * 210] bytes): per
    16 weights a scale d * sc (sc int8, d float16 per 256), q in [-32, 31]. A plain round-to-nearest
    quantizer (llama.cpp searches scales harder); enough to make valid test files."""
    rows = w.shape[0]
    x = w.reshape(-1, 16, 16).astype(np.float32)  # [blocks, sub-block, weight]
    sub = np.abs(x).max(axis=-1) / 31.0
    d = (sub.max(axis=-1) / 127.0).astype(np.float16)
    d32 = d.astype(np.float32)
    sc = np.where(d32[:, None] > 0, np.rint(sub / np.where(d32 > 0, d32, 1.0)[:, None]), 0).clip(0, 127).astype(np.int8)
    step = d32[:, None] * sc.astype(np.float32)
    q = np.where(step[..., None] > 0, np.rint(x / np.where(step > 0, step, 1.0)[..., None]), 0).clip(-32, 31)
    u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half, quarter, l]
    low = u & 0x0F
    ql = (low[:, :, :2] | (low[:, :, 2:] << 4)).reshape(-1, 128)
    qh = sum(((u[:, :, k] >> 4) << (2 * k)) for k in range(4)).astype(np.uint8).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d[:, None].view(np.uint8)], axis=1)
    return blocks.reshape(rows, -1)


def write_gguf(hf, path: Path, *, rope_freqs: np.ndarray | None = None, linear_factor: float | None = None,
               types: dict | None = None):
    """A minimal llama.cpp-style GGUF of an HF model (names, q/k permutation, experts): F32, or
    `types` {GGUF tensor-name regex: GGMLQuantizationType} quantized by `gguf.quants.quantize`."""
    gguf = pytest.importorskip("gguf")
    c = hf.config
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if linear_factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_factor)
    if arch == "qwen3moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_eos_token_id(1)

    def permute(x, n):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    if c.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    out = {}
    for k, v in sd.items():
        if k == "model.embed_tokens.weight":
            out["token_embd.weight"] = v
        elif k == "lm_head.weight":
            out["output.weight"] = v
        elif k == "model.norm.weight":
            out["output_norm.weight"] = v
        elif ".mlp.experts." in k:
            continue
        else:
            _, _, layer, rest = k.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            if arch == "llama" and mod == "self_attn.q_proj":
                v = permute(v, c.num_attention_heads)
            elif arch == "llama" and mod == "self_attn.k_proj":
                v = permute(v, c.num_key_value_heads)
            out[f"blk.{layer}.{names[mod]}.{kind}"] = v
    out.update(_gguf_experts(sd, c))
    if rope_freqs is not None:
        out["rope_freqs.weight"] = rope_freqs.astype(np.float32)
    for name, arr in out.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        qtype = next((t for pattern, t in (types or {}).items() if re.fullmatch(pattern, name)), None)
        if qtype is None:
            w.add_tensor(name, arr)
        elif qtype == gguf.GGMLQuantizationType.Q6_K:  # gguf-py has no Q6_K quantizer
            w.add_tensor(name, quantize_q6_k(arr), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

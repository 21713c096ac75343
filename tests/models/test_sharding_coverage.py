"""Every weight matrix of every target family and of the draft heads is named by a sharding rule.

`peagle_jax.sharding.PARAM_AXES` names parameters by regex over their dotted paths; a path no
rule matches is replicated on every device. A renamed parameter (or an edited rule) would
therefore not fail anything, just quietly stop being tensor-parallel. These tests pin it down:
every parameter of rank >= 2 must be matched by a rule (a rule may still replicate on purpose,
e.g. the MoE router or the drafter's fc), and every rule must match some parameter of some
module (no dead rules). The modules are built abstractly (`nnx.eval_shape`): no weights.
"""

from __future__ import annotations

import re

import pytest
from conftest import TINY_COMMON
from flax import nnx

from peagle_jax import sharding
from peagle_jax.drafters import DrafterConfig, create_drafter
from peagle_jax.models import ModelConfig, create_model
from peagle_jax.pytree_paths import param_paths
from peagle_jax.sharding import unmatched_params

# The tiny HF configs of tests/models/test_parity_hf.py (same switches), built through `from_hf_dict`
# as `load_target` does: llama with and without biases / tying, qwen2 (q/k/v biases), qwen3
# (q/k norms), qwen3_moe with dense and MoE layers mixed, and all sparse.
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
TARGETS = {
    "llama_tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama_untied_bias": dict(model_type="llama", tie_word_embeddings=False, attention_bias=True),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=24),
    "qwen3_moe": dict(model_type="qwen3_moe", tie_word_embeddings=False, decoder_sparse_step=2,
                      mlp_only_layers=[0], **MOE),
    "qwen3_moe_all_sparse": dict(model_type="qwen3_moe", tie_word_embeddings=False, attention_bias=True, **MOE),
}
# Draft heads for the llama target: EAGLE-3 and P-EAGLE, two layers (layer 0 is 2H wide, layer 1 plain).
DRAFTERS = {"eagle3": dict(parallel_drafting=False), "peagle": dict(parallel_drafting=True, mask_token_id=95)}


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(TINY_COMMON, **TARGETS[name]))


def _target(name: str) -> nnx.Module:
    return nnx.eval_shape(lambda: create_model(_config(name)))


def _drafter(name: str) -> nnx.Module:
    cfg = DrafterConfig.for_target(_config("llama_untied_bias"), num_layers=2, **DRAFTERS[name])
    return nnx.eval_shape(lambda: create_drafter(cfg))


def _all_modules() -> dict[str, nnx.Module]:
    return {**{n: _target(n) for n in TARGETS}, **{f"drafter_{n}": _drafter(n) for n in DRAFTERS}}


@pytest.fixture(scope="module")
def modules() -> dict[str, nnx.Module]:
    return _all_modules()


def _rules_used(modules) -> set[str]:
    """Patterns of the PARAM_AXES rules that decide at least one parameter (first match wins)."""
    used = set()
    for m in modules.values():
        for path, var in param_paths(m).items():
            ndim = len(var.value.shape)
            for pattern, axes in sharding.PARAM_AXES:
                if re.fullmatch(pattern, path) and len(axes) == ndim:
                    used.add(pattern)
                    break
    return used


@pytest.mark.parametrize("name", [*TARGETS, *(f"drafter_{n}" for n in DRAFTERS)])
def test_every_weight_matrix_has_a_rule(modules, name):
    m = modules[name]
    assert unmatched_params(m) == [], f"{name}: parameters no sharding rule names (would be replicated)"
    # and the check is not vacuous: the module has weight matrices, and the big ones are sharded
    params = param_paths(m)
    assert sum(len(v.value.shape) >= 2 for v in params.values()) >= 4
    axes = {p: sharding.param_logical_axes(p, len(v.value.shape)) for p, v in params.items()}
    sharded = [p for p, ax in axes.items() if any(sharding.RULES.get(a) == "model" for a in ax if a)]
    assert any("q_proj.kernel" in p for p in sharded) and any("down_proj" in p for p in sharded), sharded


def test_every_rule_is_used(modules):
    unused = [p for p, _ in sharding.PARAM_AXES if p not in _rules_used(modules)]
    assert unused == [], f"rules that match no parameter of any target family or drafter: {unused}"


def test_per_module_coverage_of_expected_layouts(modules):
    """The families really differ where the rules do: biases, tying, stacked experts, fc."""
    paths = {n: set(param_paths(m)) for n, m in modules.items()}
    assert "lm_head" not in paths["llama_tied"] and "lm_head" in paths["llama_untied_bias"]
    assert "layers.0.self_attn.q_proj.bias" in paths["qwen2"]
    assert "layers.0.mlp.gate_proj.kernel" in paths["qwen3_moe"]  # layer 0 dense (mlp_only_layers)
    assert "layers.1.mlp.gate_proj" in paths["qwen3_moe"] and "layers.1.mlp.gate.kernel" in paths["qwen3_moe"]
    assert "fc.kernel" in paths["drafter_eagle3"] and "mask_hidden" in paths["drafter_peagle"]


# ----------------------------------------------------------------------------- the check can fail


def test_dropped_rule_is_reported(monkeypatch, modules):
    kept = [(p, a) for p, a in sharding.PARAM_AXES if "o_proj" not in p]
    assert len(kept) == len(sharding.PARAM_AXES) - 1
    monkeypatch.setattr(sharding, "PARAM_AXES", kept)
    layers = TINY_COMMON["num_hidden_layers"]
    assert unmatched_params(modules["llama_tied"]) == [f"layers.{i}.self_attn.o_proj.kernel" for i in range(layers)]
    assert unmatched_params(modules["drafter_eagle3"]) == [f"layers.{i}.self_attn.o_proj.kernel" for i in range(2)]


def test_stacked_expert_rule_dropped_is_reported(monkeypatch, modules):
    monkeypatch.setattr(sharding, "PARAM_AXES", [(p, a) for p, a in sharding.PARAM_AXES if len(a) != 3])
    # the dense layer 0's MLP still matches its own rules; the MoE layers' stacked experts do not
    assert unmatched_params(modules["qwen3_moe"]) == [
        f"layers.{i}.mlp.{w}" for i in (1, 3) for w in ("down_proj", "gate_proj", "up_proj")]


def test_renamed_rule_is_reported(monkeypatch, modules):
    """A rule renamed without the parameter (or the other way round): unmatched and unused."""
    renamed = [(p.replace("down_proj", "w2"), a) for p, a in sharding.PARAM_AXES]
    monkeypatch.setattr(sharding, "PARAM_AXES", renamed)
    missing = unmatched_params(modules["qwen3"])
    assert missing == [f"layers.{i}.mlp.down_proj.kernel" for i in range(TINY_COMMON["num_hidden_layers"])]
    unused = [p for p, _ in sharding.PARAM_AXES if p not in _rules_used(modules)]
    assert unused == [r".*mlp\.w2\.kernel", r".*mlp\.w2"]


def test_renamed_parameter_is_reported():
    m = _drafter("eagle3")
    attn = m.layers[1].self_attn
    attn.out_proj = attn.o_proj  # a refactor renames the attribute...
    del attn.o_proj
    assert unmatched_params(m) == ["layers.1.self_attn.out_proj.kernel"]  # ...and the check says so


def test_min_ndim_and_rank_must_match():
    m = _target("qwen2")
    # 1-D parameters: norms replicated without a rule (small), q/k/v biases sharded by theirs
    ones = unmatched_params(m, min_ndim=1)
    assert "norm.weight" in ones and "layers.0.input_layernorm.weight" in ones
    assert not any(p.endswith("_proj.bias") for p in ones)
    assert sharding.param_logical_axes("layers.0.self_attn.q_proj.bias", 1) == ("heads",)
    # a rule only applies at its own rank: a 3-D q_proj kernel would not be matched
    assert sharding.param_logical_axes("layers.0.self_attn.q_proj.kernel", 3) == (None, None, None)

"""The front door (`peagle_jax.load`) and the entry-point bugs it fixed, each with a test that
fails on the old code."""

from __future__ import annotations

import pytest
from conftest import slow_except

from peagle_jax.api import chat_ids, resolve_drafter
from peagle_jax.checkpoints.default_model import DEFAULT_HEADS


@pytest.mark.slow
def test_readme_library_example_runs():
    from peagle_jax import load, speculative_generate  # noqa: F401  (the public names)

    llm = load()  # SmolLM2-135M-Instruct + its shipped P-EAGLE head
    out = llm.generate([llm.encode_chat("Write a haiku about JAX.")], max_new_tokens=8)
    print(llm.decode(out.tokens[0]))
    assert llm.method == "peagle" and llm.drafter.config.parallel_drafting
    assert len(out.tokens[0]) == 8 and out.mean_acceptance_length >= 1.0


@pytest.mark.parametrize("model", [None, "default", "smollm2-135m-instruct", "SmolLM2-135M-Instruct"])
def test_every_default_model_alias_gets_the_shipped_head(model):
    # Old generate: only --model default found the head; "smollm2-135m-instruct" ran without one.
    assert resolve_drafter(model, "auto", "auto").endswith(DEFAULT_HEADS["peagle"])
    assert resolve_drafter(model, "auto", "eagle3").endswith(DEFAULT_HEADS["eagle3"])
    assert resolve_drafter(model, "auto", "none") is None
    assert resolve_drafter(model, "none", "auto") is None


def test_other_models_get_no_head_and_bad_methods_are_named():
    assert resolve_drafter("/models/other.gguf", "auto", "auto") is None
    assert resolve_drafter("/models/other.gguf", "/heads/h", "auto") == "/heads/h"
    with pytest.raises(ValueError, match="method must be one of"):
        resolve_drafter(None, "auto", "medusa")


@pytest.mark.slow
def test_server_with_method_eagle3_loads_the_eagle3_head():
    # Old serve/app.py resolved default_drafter_path("peagle") whatever --method said.
    from peagle_jax.serve.app import load_models
    from peagle_jax.serve.config import ServeConfig

    llm = load_models(ServeConfig(method="eagle3", dtype="float32"))
    assert llm.method == "eagle3" and not llm.drafter.config.parallel_drafting
    assert llm.model_name == "smollm2-135m-instruct"


def test_server_config_has_kernel_and_fp8_settings():
    from peagle_jax.serve.config import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(
        ["--attention", "xla", "--kv-cache-dtype", "float8_e4m3fn", "--fp8-weights"]))
    assert (cfg.attention, cfg.kv_cache_dtype, cfg.experimental.fp8_weights) == ("xla", "float8_e4m3fn", True)
    assert cfg.options().experimental.fp8_weights and not hasattr(cfg.options(), "port")


def test_every_option_is_a_flag_of_generate_and_serve():
    """The settings are listed once (Options); both CLIs take each of them, with the same meaning."""
    from peagle_jax.generate.__main__ import build_parser as generate_parser
    from peagle_jax.options import Experimental, Options, options_from_args
    from peagle_jax.serve.config import build_parser as serve_parser
    from peagle_jax.serve.config import config_from_args

    argv = ["--model", "m.gguf", "--method", "peagle+ngram", "-k", "5", "--dtype", "float32", "--matmul", "xla",
            "--prompt-lookup-max", "6", "--head-draft-tokens", "2", "--two-chains", "--drafter", "h"]
    from_generate = options_from_args(generate_parser().parse_args(["--prompt", "p", *argv]))
    from_serve = config_from_args(serve_parser().parse_args(argv)).options()
    assert from_generate == from_serve
    assert (from_serve.method, from_serve.num_draft_tokens, from_serve.prompt_lookup_max) == ("peagle+ngram", 5, 6)
    assert from_serve.experimental.two_chains and from_serve.drafter == "h"
    for name in [*Options.model_fields, *Experimental.model_fields]:
        if name in ("experimental", "served_model_name"):
            continue
        flag = "--" + name.replace("_", "-")
        assert flag in generate_parser().format_help() and flag in serve_parser().format_help(), flag


def test_options_validate_once_with_clear_messages():
    from pydantic import ValidationError

    from peagle_jax.options import Options

    assert Options().replace(second_root=True).experimental.second_root  # flat experimental names
    assert Options(mesh={"data": 1, "model": 1}).mesh is None and Options(mesh="model=2").mesh == "data=1,model=2"
    for bad, needle in [(dict(draft_cutoff=0.2, second_root=True), "do not combine"),
                        (dict(method="ngram", drafter="h"), "takes no head"),
                        (dict(prompt_lookup_min=5), "prompt_lookup_min"),
                        (dict(head_draft_tokens=2, method="peagle"), "head_draft_tokens"),
                        (dict(draft_weights="q4", dtype="float32"), "CPU matmul kernel"),
                        (dict(mesh="pipeline=2"), "mesh"),
                        (dict(num_draft_tokens=0), "num_draft_tokens"),
                        (dict(speed="fast"), "speed")]:
        with pytest.raises(ValidationError, match=needle):
            Options(**bad)


@pytest.mark.slow
def test_peagle_method_rejects_a_sequential_head():
    from peagle_jax import load

    with pytest.raises(ValueError, match="parallel-drafting"):
        load(drafter=resolve_drafter(None, "auto", "eagle3"), method="peagle", dtype="float32")


def test_distributed_env_is_read_one_way(monkeypatch):
    from peagle_jax import sharding

    for v in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "PEAGLE_DISTRIBUTED"):
        monkeypatch.delenv(v, raising=False)
    assert sharding.maybe_initialize_distributed() is False
    monkeypatch.setenv("PEAGLE_DISTRIBUTED", "0")
    assert sharding.maybe_initialize_distributed() is False
    monkeypatch.setenv("PEAGLE_DISTRIBUTED", "yes please")
    with pytest.raises(ValueError, match="PEAGLE_DISTRIBUTED"):
        sharding.maybe_initialize_distributed()
    monkeypatch.delenv("PEAGLE_DISTRIBUTED")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES, JAX_PROCESS_ID"):
        sharding.maybe_initialize_distributed()
    # train uses the same function (it had its own copy, where PEAGLE_DISTRIBUTED meant "1" only)
    import peagle_jax.train.train as train_loop

    assert train_loop.maybe_initialize_distributed is sharding.maybe_initialize_distributed


def test_chat_ids_accepts_text_or_messages():
    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt):
            assert add_generation_prompt
            return {"input_ids": [len(messages), 7]}  # a BatchEncoding-like mapping

    assert chat_ids(Tok(), "hi") == [1, 7]
    assert chat_ids(Tok(), [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == [2, 7]


@pytest.mark.slow
def test_generate_cli_with_the_default_model_name(capsys):
    from peagle_jax.generate.__main__ import main

    rc = main(["--prompt", "Say hi.", "--chat", "--model", "smollm2-135m-instruct", "--max-new-tokens", "4",
               "--no-warmup", "--dtype", "float32", "-k", "2"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "using the shipped draft head smollm2-135m-peagle" in err and "[peagle]" in err


@pytest.mark.parametrize("method", slow_except(sorted(DEFAULT_HEADS), fast={"peagle"}))
def test_shipped_heads_carry_their_lm_head_and_match_their_manifest(method):
    # vLLM substitutes the target's full lm_head when a head has none, and then accepts no drafts.
    import json

    import numpy as np

    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.default_model import default_drafter_path, default_model_path
    from peagle_jax.checkpoints.drafter_io import read_tensors
    from peagle_jax.train.manifest import sha256_file

    head = default_drafter_path(method)
    tensors = read_tensors(head)  # one file or HF shards
    assert str(tensors["lm_head.weight"].dtype) == "bfloat16"
    draft_ids = np.arange(tensors["lm_head.weight"].shape[0]) + tensors["d2t"]
    lm_head = np.asarray(tensors["lm_head.weight"], np.float32)
    target = load_target(default_model_path(), dtype="bfloat16")
    expected = np.asarray(target.lm_head_weight(), np.float32)[:, draft_ids].T
    np.testing.assert_array_equal(lm_head, expected)
    files = json.loads((head / "manifest.json").read_text())["files"]
    assert {name: sha256_file(head / name) for name in files} == {n: v["sha256"] for n, v in files.items()}


@pytest.mark.slow
def test_reexport_of_a_shipped_head_is_bit_identical(tmp_path):
    # `export --head` rewrote the shipped heads with their lm_head; doing it again changes nothing.
    import numpy as np
    from safetensors import safe_open

    from peagle_jax.checkpoints.default_model import default_drafter_path
    from peagle_jax.train.export import main as export_main

    head = default_drafter_path("eagle3")
    export_main(["--head", str(head), "--out", str(tmp_path / "again")])
    with safe_open(head / "model.safetensors", "flax") as a, safe_open(tmp_path / "again" / "model.safetensors",
                                                                         "flax") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            np.testing.assert_array_equal(np.asarray(a.get_tensor(k)), np.asarray(b.get_tensor(k)), err_msg=k)
    assert (head / "config.json").read_text() == (tmp_path / "again" / "config.json").read_text()
    with pytest.raises(SystemExit):
        export_main(["--head", str(head), "--out", str(head)])


@pytest.mark.slow
def test_export_gives_a_head_the_vocabulary_of_generated_answers(tmp_path):
    # `export --head H --vocab-from DATA`: the draft vocabulary becomes the answers' most frequent
    # tokens (EOS forced in), the lm_head the target's rows for them, every other tensor unchanged.
    import json

    import numpy as np

    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.default_model import default_drafter_path, default_model_path
    from peagle_jax.checkpoints.drafter_io import read_tensors
    from peagle_jax.train.export import main as export_main

    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    common = rng.choice(np.arange(100, 49000), 300, replace=False)
    from peagle_jax.train.shards import Record, write_shard

    # prompt tokens (ids < 100) do not count; response tokens do
    write_shard(data, "train", [Record(f"x{i}", "math", 1, rng.integers(3, 100, 20).tolist(),
                                       rng.choice(common, 50).tolist()) for i in range(40)], vocab_size=49152)
    head = default_drafter_path("peagle")
    out = tmp_path / "revocab"
    export_main(["--head", str(head), "--out", str(out), "--vocab-from", str(data), "--draft-vocab-size", "302"])
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 302
    a, b = read_tensors(head), read_tensors(out)  # one file or HF shards
    ids = np.arange(302) + b["d2t"]
    extra = set(ids.tolist()) - set(common.tolist())  # every response token, EOS, no prompt token
    assert len(extra) == 2 and 2 in extra and extra <= {0, 1, 2}
    target = load_target(default_model_path(), dtype="bfloat16")
    expected = np.asarray(target.lm_head_weight(), np.float32)[:, ids].T
    np.testing.assert_array_equal(np.asarray(b["lm_head.weight"], np.float32), expected)
    for k in set(a) - {"d2t", "t2d", "lm_head.weight"}:
        np.testing.assert_array_equal(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32), err_msg=k)
    with pytest.raises(SystemExit):
        export_main(["--head", str(head), "--out", str(tmp_path / "x"), "--draft-vocab-size", "10"])
    with pytest.raises(FileNotFoundError, match="holds no train shards"):
        export_main(["--head", str(head), "--out", str(tmp_path / "y"), "--vocab-from", str(tmp_path)])


@pytest.mark.parametrize(("method", "layers"), [("peagle", 4), ("eagle3", 1)])
def test_the_qwen_coder_05b_heads_ship_whole_and_match_their_manifests(method, layers):
    # over 20 MiB in bf16, so HF shards with an index (drafter_io.save_drafter); the manifest covers them all
    import json

    from peagle_jax.checkpoints.default_model import shipped_drafter_path
    from peagle_jax.train.manifest import sha256_file

    head = shipped_drafter_path("qwen2.5-coder-0.5b-instruct", method)
    assert head is not None and head.name == f"qwen2.5-coder-0.5b-{method}"
    config = json.loads((head / "config.json").read_text())
    assert bool(config.get("parallel_drafting")) == (method == "peagle")
    assert config["num_hidden_layers"] == layers and config["hidden_size"] == 896
    index = json.loads((head / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert {"lm_head.weight", "d2t", "fc.weight"} <= set(index["weight_map"])
    assert ("mask_hidden" in index["weight_map"]) == (method == "peagle")
    manifest = json.loads((head / "manifest.json").read_text())
    assert set(manifest["files"]) == shards | {"config.json", "model.safetensors.index.json"}
    recorded = {n: v["sha256"] for n, v in manifest["files"].items()}
    assert {n: sha256_file(head / n) for n in recorded} == recorded
    assert manifest["method"] == method and manifest["tokens_read"]["answer_tokens"] >= 1_000_000


@pytest.mark.slow
@pytest.mark.parametrize(("method", "layers"), [("peagle", 4), ("eagle3", 1)])
def test_load_picks_up_the_qwen_coder_05b_heads_and_stays_exact(method, layers):
    from peagle_jax import load
    from peagle_jax.checkpoints.default_model import resolve_model_path

    try:
        resolve_model_path("qwen2.5-coder-0.5b-instruct")
    except FileNotFoundError as e:
        pytest.skip(f"qwen2.5-coder-0.5b-instruct is not installed (bash scripts/setup.sh --model "
                    f"qwen2.5-coder-0.5b-instruct): {e}")
    spec = load("qwen2.5-coder-0.5b-instruct", method=method)
    assert spec.drafter is not None and spec.drafter.config.num_hidden_layers == layers
    assert spec.method == method
    plain = load("qwen2.5-coder-0.5b-instruct", method="none")
    ids = spec.encode_chat("Write a Python function that returns the n-th Fibonacci number.")
    out = spec.generate([ids], max_new_tokens=48, num_draft_tokens=3)
    assert out.tokens == plain.generate([ids], max_new_tokens=48).tokens
    assert out.mean_acceptance_length > 1.2  # a trained head (1.42 measured), not a random one (about 1.0)

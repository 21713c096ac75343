"""The self-distillation prompt mix, the resumable answer generation, and its committed shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import tiny_target_with_real_tokenizer

from peagle_jax.train.generate_data import generate_answers, magpie_prompts, user_turn_prefix
from peagle_jax.train.prompts import DOMAINS, Prompt, build_prompts
from peagle_jax.train.shards import Record, read_records, shard_paths, write_manifest, write_shard


@pytest.fixture(scope="module")
def llm():
    from peagle_jax.api import LoadedModel

    target, tok, eos = tiny_target_with_real_tokenizer(layers=2, seed=3)
    return LoadedModel.from_target(target, tok, eos_ids=eos, name="tiny")


@pytest.mark.slow
def test_prompt_mix_covers_the_domains_and_keeps_the_splits_apart():
    train, val = build_prompts("train", math_problems=200), build_prompts("val", math_problems=200)
    domains = {p.domain for p in train}
    assert {"code_complete", "code_explain", "code_tests", "code_task", "docs_summary", "rewrite", "math",
            "chat"} <= domains
    assert "chat" in {p.domain for p in val}
    assert domains <= set(DOMAINS)
    assert not {p.id for p in train} & {p.id for p in val}
    assert [p.id for p in build_prompts("train", math_problems=200)] == [p.id for p in train]  # deterministic
    assert len({p.id for p in train}) == len(train)
    assert not any("HumanEval" in p.id or "mt_bench" in p.id for p in train)
    # The copy-heavy benchmark's passages (held-out topics) never appear in training prompts.
    from benchmarks.copy_heavy import load_copy_heavy

    held_out = {it["id"].split("/", 1)[1] for it in load_copy_heavy() if it["category"] == "docs_qa"}
    assert not any(p.id.split("/")[1] in held_out for p in train if p.domain in ("docs_summary", "rewrite"))


def test_answers_resume_from_shards_without_duplicates_and_add_follow_ups(llm, tmp_path):
    prompts = [Prompt(f"t/{i}", "math", f"What is {i} plus {i}?") for i in range(5)]
    folder = tmp_path / "data"
    written = []
    generate_answers(llm, prompts, folder, target_tokens=10**6, batch=2, max_new_tokens=6, shard_tokens=8,
                     on_shard=written.append, log=lambda *_: None)
    first = read_records(folder, "train")
    assert len(written) >= 2 and written == shard_paths(folder, "train")  # several shards, each reported
    assert sorted(r.name for r in first) == [p.id for p in prompts]
    assert all(r.turn == 1 and 1 <= len(r.response) <= 6 for r in first)
    ref = llm.generate([llm.encode_chat(prompts[0].text)], method="none", max_new_tokens=6)
    assert next(r for r in first if r.name == "t/0").response == ref.tokens[0]  # the target's greedy answer
    # A killed writer leaves a temporary file, never a shard: a rerun ignores it, and neither
    # repeats nor loses records.
    (folder / ".train-00009.npz.tmp").write_bytes(b"partial")
    summary = generate_answers(llm, prompts, folder, target_tokens=10**6, batch=2, max_new_tokens=6,
                               follow_up_share=1.0, log=lambda *_: None)
    records = read_records(folder, "train")
    assert sorted((r.name, r.turn) for r in records) == sorted((p.id, t) for p in prompts for t in (1, 2))
    assert summary["follow_ups"] == 5 and summary["conversations"] == {"math": 5}
    assert all(len(r.prompt) > len(next(f for f in first if f.name == r.name).prompt) for r in records if r.turn == 2)


def test_answer_budget_stops_the_run(llm, tmp_path):
    prompts = [Prompt(f"b/{i}", "math", f"Count to {i}.") for i in range(8)]
    summary = generate_answers(llm, prompts, tmp_path, target_tokens=10, batch=2, max_new_tokens=6,
                               log=lambda *_: None)
    assert 10 <= summary["total_answer_tokens"] <= 10 + 4 * 6  # stops once the requests in flight end
    assert summary["conversations"]["math"] < 8


def test_shards_round_trip_atomically_and_refuse_bad_input(tmp_path):
    recs = [Record("a", "math", 1, [1, 2, 3], [4, 5]), Record("b", "code_task", 2, [7], [65535, 9])]
    path = write_shard(tmp_path, "train", recs, vocab_size=65536)
    assert path.name == "train-00000.npz" and read_records(tmp_path, "train") == recs
    with np.load(path) as z:
        assert z["tokens"].dtype == np.uint16  # the vocabulary fits 16 bits
    big = [Record("c", "math", 1, [100_000], [151_000])]
    assert write_shard(tmp_path, "train", big, vocab_size=151_936).name == "train-00001.npz"
    assert read_records(tmp_path, "train") == recs + big
    with pytest.raises(ValueError, match="must lie in"):
        write_shard(tmp_path, "train", [Record("d", "math", 1, [5], [70_000])], vocab_size=65536)
    with pytest.raises(ValueError, match="at least one record"):
        write_shard(tmp_path, "val", [], vocab_size=10)
    assert len(shard_paths(tmp_path, "train")) == 2 and not list(tmp_path.glob(".*"))  # nothing half-written
    manifest = write_manifest(tmp_path, {"model": "m"})
    assert manifest["train"]["total_answer_tokens"] == 5 and manifest["train"]["follow_ups"] == 1
    assert [s["file"] for s in manifest["train"]["shards"]] == ["train-00000.npz", "train-00001.npz"]
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    (tmp_path / "train-00002.npz").write_bytes(b"not a shard")
    with pytest.raises(ValueError, match="train-00002.npz cannot be read"):
        read_records(tmp_path, "train")


@pytest.mark.slow
def test_magpie_starts_from_the_user_turn_and_resumes(llm, tmp_path):
    prefix = user_turn_prefix(llm.tokenizer)
    assert prefix.endswith("<|im_start|>user\n") and "<|im_start|>system" in prefix
    out = tmp_path / "magpie.jsonl"
    got = magpie_prompts(llm, out, 2, batch=2, max_new_tokens=16, log=lambda *_: None)
    # A random tiny target rarely ends a turn; whatever it kept passed the filters, and a rerun
    # returns the same prompts without generating new ones.
    assert all(15 <= len(p.text) <= 400 and p.domain == "magpie" for p in got)
    attempts = [json.loads(line)["attempt"] for line in out.read_text().splitlines()]
    assert attempts and sorted(attempts) == list(range(len(attempts)))  # each seed drawn once, all logged
    again = magpie_prompts(llm, out, len(got), batch=2, max_new_tokens=16, log=lambda *_: None)
    assert [p.id for p in again] == [p.id for p in got]


def test_generated_answers_feed_training_documents(llm, tmp_path):
    from peagle_jax.train.config import load_config
    from peagle_jax.train.features import load_documents

    prompts = [Prompt(f"g/{i}", "math", f"What is {i} times two?") for i in range(4)]
    generate_answers(llm, prompts, tmp_path, target_tokens=10**6, batch=2, max_new_tokens=6, log=lambda *_: None)
    records = read_records(tmp_path, "train")
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "data": {
        "source": "generated", "generated_dir": str(tmp_path), "seq_len": 64, "max_doc_tokens": 128}})
    docs = load_documents(cfg, "train", llm.target, llm.tokenizer, llm.eos_ids)
    assert sorted(d.name for d in docs) == sorted(r.name + "#0" for r in records)  # one chunk each
    for d in docs:  # the loss falls on the answer tokens only
        r = next(r for r in records if r.name + "#0" == d.name)
        assert d.tokens.tolist() == r.prompt + r.response
        assert d.loss_mask.tolist() == [0] * len(r.prompt) + [1] * len(r.response)
    with pytest.raises(FileNotFoundError, match="generate_data --out .* --split val"):
        load_documents(cfg, "val", llm.target, llm.tokenizer, llm.eos_ids)


def test_self_written_user_turns_are_english_prose():
    from peagle_jax.train.generate_data import good_user_turn

    assert good_user_turn("How do I sort a dictionary by its values in Python?")
    assert good_user_turn("def add(a, b):\n    return a + b\n\nWhy does this fail for strings?")
    for bad in ["static_cast也是一个提升可读性的辅助工具吗？", "#include <vector>\nint main() {}", "short",
                "<|im_start|>user something long enough", "x" * 401]:
        assert not good_user_turn(bad), bad


def test_each_shard_keeps_the_weights_that_wrote_it(tmp_path):
    """A resumed run may switch target weights (the faster on its host): shards written before
    keep the earlier run's setting, recorded or not."""
    import json

    from peagle_jax.train.generate_data import _old_manifest, _weights_by_shard

    assert _weights_by_shard(_old_manifest(tmp_path)) == {}
    old = {"target_weights": "file", "train": {"shards": [{"file": "train-00000.npz"}, {"file": "train-00001.npz"}]},
           "val": {"shards": []}}
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    assert _weights_by_shard(_old_manifest(tmp_path)) == {"train-00000.npz": "file", "train-00001.npz": "file"}
    old["target_weights_by_shard"] = {"train-00000.npz": "file", "train-00001.npz": "bf16"}
    old["target_weights"] = "bf16"
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    assert _weights_by_shard(_old_manifest(tmp_path))["train-00001.npz"] == "bf16"


def test_domains_flag_names_what_is_unknown(capsys):
    """A run on some domains rebalances a folder; a misspelt domain stops before the model loads."""
    from peagle_jax.train.generate_data import main

    with pytest.raises(SystemExit) as e:
        main(["--domains", "math,chitchat"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "chitchat" in err and "chat" in err


def test_manifest_keeps_every_runs_command(tmp_path):
    from peagle_jax.train.generate_data import _old_manifest, _previous_runs

    assert _previous_runs(_old_manifest(tmp_path)) == []
    (tmp_path / "manifest.json").write_text(json.dumps({"command": "first"}))
    assert _previous_runs(_old_manifest(tmp_path)) == ["first"]
    (tmp_path / "manifest.json").write_text(json.dumps({"command": "second", "runs": ["first", "second"]}))
    assert _previous_runs(_old_manifest(tmp_path)) == ["first", "second"]

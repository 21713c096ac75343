"""The self-distillation prompt mix and the resumable answer generation (issue #13)."""

from __future__ import annotations

import json

import pytest

from peagle_jax.train.generate_data import generate_answers, magpie_prompts, user_turn_prefix
from peagle_jax.train.prompts import DOMAINS, Prompt, build_prompts


@pytest.fixture(scope="module")
def llm():
    from peagle_jax.api import LoadedModel
    from peagle_jax.checkpoints.default_model import default_model_path
    from peagle_jax.checkpoints.tokenizer import eos_token_ids, load_tokenizer
    from peagle_jax.models import ModelConfig, create_model

    tok = load_tokenizer(default_model_path())
    cfg = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=512)
    return LoadedModel.from_target(create_model(cfg, seed=3), tok, eos_ids=eos_token_ids(tok), name="tiny")


def test_prompt_mix_covers_the_domains_and_keeps_the_splits_apart():
    train, val = build_prompts("train", math_problems=200), build_prompts("val", math_problems=200)
    domains = {p.domain for p in train}
    assert {"code_complete", "code_explain", "code_tests", "code_task", "docs_summary", "rewrite", "math"} <= domains
    assert domains <= set(DOMAINS)
    assert not {p.id for p in train} & {p.id for p in val}
    assert [p.id for p in build_prompts("train", math_problems=200)] == [p.id for p in train]  # deterministic
    assert len({p.id for p in train}) == len(train)
    assert not any("HumanEval" in p.id or "mt_bench" in p.id for p in train)
    # The copy-heavy benchmark's passages (held-out topics) never appear in training prompts.
    from benchmarks.copy_heavy import load_copy_heavy

    held_out = {it["id"].split("/", 1)[1] for it in load_copy_heavy() if it["category"] == "docs_qa"}
    assert not any(p.id.split("/")[1] in held_out for p in train if p.domain in ("docs_summary", "rewrite"))


def test_answers_resume_without_duplicates_and_add_follow_ups(llm, tmp_path):
    prompts = [Prompt(f"t/{i}", "math", f"What is {i} plus {i}?") for i in range(5)]
    out = tmp_path / "answers.jsonl"
    generate_answers(llm, prompts, out, target_tokens=10**6, batch=2, max_new_tokens=6, follow_up_share=0.0)
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["name"] for r in first] and sorted(r["name"] for r in first) == [p.id for p in prompts]
    assert all(r["turn"] == 1 and 1 <= len(r["response"]) <= 6 for r in first)
    ref = llm.generate([llm.encode_chat(prompts[0].text)], method="none", max_new_tokens=6)
    assert next(r for r in first if r["name"] == "t/0")["response"] == ref.tokens[0]  # the target's greedy answer
    # A killed run leaves a partial line: it is dropped, and a rerun neither repeats nor loses records.
    out.write_text(out.read_text() + '{"name": "t/9", "tur')
    summary = generate_answers(llm, prompts, out, target_tokens=10**6, batch=2, max_new_tokens=6,
                               follow_up_share=1.0)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 10 and sorted((r["name"], r["turn"]) for r in records) == sorted(
        (p.id, t) for p in prompts for t in (1, 2))
    assert summary["follow_ups"] == 5 and summary["conversations"] == {"math": 5}
    assert all(len(r["prompt"]) > len(next(f for f in first if f["name"] == r["name"])["prompt"])
               for r in records if r["turn"] == 2)


def test_answer_budget_stops_the_run(llm, tmp_path):
    prompts = [Prompt(f"b/{i}", "math", f"Count to {i}.") for i in range(8)]
    out = tmp_path / "a.jsonl"
    summary = generate_answers(llm, prompts, out, target_tokens=10, batch=2, max_new_tokens=6)
    assert 10 <= summary["total_answer_tokens"] <= 10 + 2 * 6  # stops after the batch that crossed it
    assert summary["conversations"]["math"] < 8


def test_magpie_starts_from_the_user_turn_and_resumes(llm, tmp_path):
    prefix = user_turn_prefix(llm.tokenizer)
    assert prefix.endswith("<|im_start|>user\n") and "<|im_start|>system" in prefix
    out = tmp_path / "magpie.jsonl"
    got = magpie_prompts(llm, out, 2, batch=2, max_new_tokens=16, log=lambda *_: None)
    # A random tiny target rarely ends a turn; whatever it kept passed the filters, and a rerun
    # returns the same prompts without generating new ones.
    assert all(15 <= len(p.text) <= 400 and p.domain == "magpie" for p in got)
    again = magpie_prompts(llm, out, len(got), batch=2, max_new_tokens=16, log=lambda *_: None)
    assert [p.id for p in again] == [p.id for p in got]


def test_generated_answers_feed_training_documents(llm, tmp_path):
    from peagle_jax.train.config import load_config
    from peagle_jax.train.features import load_documents

    prompts = [Prompt(f"g/{i}", "math", f"What is {i} times two?") for i in range(4)]
    out = tmp_path / "answers_train.jsonl"
    generate_answers(llm, prompts, out, target_tokens=10**6, batch=2, max_new_tokens=6)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    out.write_text(out.read_text() + '{"name": "g/9", "pro')  # a writer still running: partial last line
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "data": {
        "source": "generated", "generated_dir": str(tmp_path), "seq_len": 64, "max_doc_tokens": 128}})
    docs = load_documents(cfg, "train", llm.target, llm.tokenizer, llm.eos_ids)
    assert sorted(d.name for d in docs) == sorted(r["name"] + "#0" for r in records)  # one chunk each
    for d in docs:  # the loss falls on the answer tokens only
        r = next(r for r in records if r["name"] + "#0" == d.name)
        assert d.tokens.tolist() == r["prompt"] + r["response"]
        assert d.loss_mask.tolist() == [0] * len(r["prompt"]) + [1] * len(r["response"])
    with pytest.raises(FileNotFoundError, match="generate_data --out .* --split val"):
        load_documents(cfg, "val", llm.target, llm.tokenizer, llm.eos_ids)

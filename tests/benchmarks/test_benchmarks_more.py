"""Smoke tests of the benchmark scripts that tests/benchmarks/test_benchmarks_smoke.py does not cover:
acceptance.py, decode_speed.py, fp8_accuracy.py and peer_hf.py, each through its `main(argv)`.

They normally run on the default SmolLM2-135M; here `--model` points them at a tiny random
llama saved as an HF directory with SmolLM2's tokenizer (so the chat prompts and the HF peer
work unchanged), and the heads are random EAGLE-3 / P-EAGLE heads saved next to it. The checks
are on the reports (files written, fields present and consistent with each other and with
the exactness guarantees), never on wall-clock values.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

NEW = 6  # new tokens per prompt


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _md_rows(text: str) -> list[list[str]]:
    """Data rows of the first Markdown table in `text` (header and separator dropped)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


@pytest.fixture(scope="module")
def tiny_dir(make_tiny_hf, tmp_path_factory):
    """A tiny random llama (3 layers: distinct EAGLE-3 taps 0, 1, 2) with SmolLM2's tokenizer."""
    from peagle_jax.checkpoints.default_model import default_model_path
    from peagle_jax.checkpoints.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    d = tmp_path_factory.mktemp("tiny_hf")
    hf = make_tiny_hf("llama", seed=5, vocab_size=len(tok), num_hidden_layers=3, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    hf.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def heads(tiny_dir, tmp_path_factory):
    """Random one-layer heads for the tiny target, saved as head directories: {method: path}."""
    from benchmarks.common import random_drafter
    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.drafter_io import save_drafter

    target = load_target(tiny_dir)
    d = tmp_path_factory.mktemp("heads")
    out = {}
    for method, parallel in (("eagle3", False), ("peagle", True)):
        out[method] = save_drafter(random_drafter(target, parallel=parallel, seed=7), d / method,
                                   target_config=target.config)
    return out


# ----------------------------------------------------------------------------- acceptance.py


@pytest.mark.slow
def test_acceptance_tiny(tiny_dir, heads, tmp_path):
    from benchmarks import acceptance

    out = tmp_path / "acc"
    k = 2
    s = acceptance.main(["--model", str(tiny_dir), "--peagle-head", str(heads["peagle"]),
                         "--eagle3-head", str(heads["eagle3"]), "--ks", str(k), "--max-new-tokens", str(NEW),
                         "--batch", "2", "--limit", "1", "--dtype", "float32", "--out", str(out)])
    doc = json.loads((out / "acceptance.json").read_text())
    assert doc["results"] == s["results"] and doc["dtype"] == "float32" and doc["max_new_tokens"] == NEW
    assert doc["heads"] == {"peagle": str(heads["peagle"]), "eagle3": str(heads["eagle3"])}
    assert doc["machine"]["jax_backend"] and doc["wall_time_s"] > 0
    rows = doc["results"]
    assert sorted((r["dataset"], r["method"], r["k"]) for r in rows) == sorted(
        (ds, m, k) for ds in ("HumanEval (1)", "MT-Bench coding (1)") for m in ("eagle3", "peagle"))
    for r in rows:
        assert r["prompts"] == 1
        assert r["mismatches_vs_greedy"] == 0, r  # speculative decoding is exact
        assert 1.0 <= r["acceptance_length"] <= k + 1
        assert len(r["per_position"]) == k and all(0.0 <= p <= 1.0 for p in r["per_position"])
        # AL = 1 + sum of the per-position acceptance rates (both per verify round)
        assert r["acceptance_length"] == pytest.approx(1.0 + sum(r["per_position"]))
    md = _md_rows((out / "acceptance.md").read_text())
    assert len(md) == len(rows)
    assert [(c[0], c[1], int(c[2]), float(c[3]), int(c[5])) for c in md] == [
        (r["dataset"], r["method"], r["k"], round(r["acceptance_length"], 2), r["mismatches_vs_greedy"]) for r in rows]


def test_acceptance_summarize():
    import numpy as np

    from benchmarks.acceptance import summarize

    # 2 sequences, 4 + 6 rounds; accepted drafts per position [K=2]
    al, per = summarize(np.array([4, 6]), np.array([[3, 1], [5, 2]]))
    assert al == pytest.approx((10 + 11) / 10) and per == pytest.approx([0.8, 0.3])


# ----------------------------------------------------------------------------- decode_speed.py


@pytest.mark.slow
def test_decode_speed_tiny(tiny_dir, tmp_path):
    from benchmarks import decode_speed

    out = tmp_path / "ds"
    s = decode_speed.main(["--model", str(tiny_dir), "--prompts", "2", "--max-new-tokens", str(NEW), "--out", str(out)])
    doc = json.loads((out / "decode_speed.json").read_text())
    assert doc == json.loads(json.dumps(s))
    assert doc["max_new_tokens"] == NEW and len(doc["rows"]) == 2
    assert [r["prompt"] for r in doc["rows"]] == decode_speed.PROMPTS[:2]
    assert set(doc["ours"]) == {"bfloat16", "bfloat16/xla", "float32"}
    for r in doc["rows"]:
        assert r["tokens"] == NEW and _finite_positive(r["hf_tok_s"])
        assert all(_finite_positive(r[f"ours_{d}_tok_s"]) for d in decode_speed.CONFIGS)
        # same fp32 weights and arithmetic, both greedy and ignoring EOS: the very same tokens
        assert r["ours_float32_identical_to_hf"] is True
    for d, o in doc["ours"].items():
        assert o["tok_s"] == pytest.approx(sum(r[f"ours_{d}_tok_s"] for r in doc["rows"]) / 2)
        assert o["speedup"] == pytest.approx(o["tok_s"] / doc["transformers_tok_s"])
    assert doc["ours"]["float32"]["identical_to_hf"] == 2
    md = _md_rows((out / "decode_speed.md").read_text())
    assert len(md) == 3 and md[-1][0] == "**mean**"
    assert f"{doc['ours']['bfloat16']['speedup']:.2f}x" in md[-1][1]
    assert f"{doc['ours']['bfloat16/xla']['speedup']:.2f}x" in md[-1][2]
    assert f"{doc['ours']['float32']['speedup']:.2f}x" in md[-1][3]


# ----------------------------------------------------------------------------- fp8_accuracy.py

VARIANTS = ["fp32", "bf16", "fp8_kv", "fp8_weights", "fp8_kv+fp8_weights"]


@pytest.mark.slow
def test_fp8_accuracy_tiny(tiny_dir, tmp_path):
    from benchmarks import fp8_accuracy

    out = tmp_path / "fp8"
    rows = fp8_accuracy.main(["--model", str(tiny_dir), "--prompts", "1", "--max-new-tokens", str(NEW),
                              "--hf", "--out", str(out)])
    doc = json.loads((out / "fp8_accuracy.json").read_text())
    assert doc == rows and [r["variant"] for r in doc] == VARIANTS
    by = {r["variant"]: r for r in doc}
    # fp32 against itself: exact
    assert by["fp32"]["max_abs_logit_error"] == 0.0 and by["fp32"]["top1_agreement"] == 1.0
    assert by["fp32"]["greedy_tokens_before_divergence"] == [NEW]
    # --hf: our fp32 forward is transformers' up to float rounding; bf16 is further from it
    assert by["fp32"]["hf_max_abs_logit_error"] < 1e-3
    assert by["bf16"]["hf_mean_abs_logit_error"] > by["fp32"]["hf_mean_abs_logit_error"]
    for name in VARIANTS[1:]:
        r = by[name]
        # every reduced-precision variant really differs from fp32 (the option took effect)
        assert 0.0 < r["mean_abs_logit_error"] <= r["max_abs_logit_error"] < math.inf, r
        assert 0.0 <= r["top1_agreement"] <= 1.0
        assert len(r["greedy_tokens_before_divergence"]) == 1 and 0 <= r["greedy_tokens_before_divergence"][0] <= NEW
        assert "mean_acceptance_length" not in r  # no --head
    md = _md_rows((out / "fp8_accuracy.md").read_text())
    assert [c[0] for c in md] == VARIANTS and md[0][-1] == f"[{NEW}]" and len(md[0]) == 8


@pytest.mark.slow
def test_fp8_accuracy_with_head(tiny_dir, heads, tmp_path):
    from benchmarks import fp8_accuracy

    out = tmp_path / "fp8h"
    rows = fp8_accuracy.main(["--model", str(tiny_dir), "--prompts", "1", "--max-new-tokens", str(NEW),
                              "--head", str(heads["peagle"]), "-k", "2", "--out", str(out)])
    for r in rows:
        assert 1.0 <= r["mean_acceptance_length"] <= 3.0
    assert "mean_acceptance_length" in (out / "fp8_accuracy.md").read_text()


# ----------------------------------------------------------------------------- peer_hf.py


def test_peer_hf_tiny(tiny_dir, tmp_path):
    from benchmarks import peer_hf

    out = tmp_path / "peer"
    # The assistant is the target itself: assisted decoding then runs (and must be exact).
    s = peer_hf.main(["--model", str(tiny_dir), "--dataset", "mtbench", "--limit", "2", "--max-new-tokens", str(NEW),
                      "--ignore-eos", "--torch-threads", "1", "--prompt-lookup-tokens", "3",
                      "--assistant", str(tiny_dir), "--out", str(out)])
    doc = json.loads((out / "peer_hf.json").read_text())
    assert doc["results"] == json.loads(json.dumps(s["results"]))
    assert doc["model"] == str(tiny_dir) and doc["prompts"] == 2 and doc["eos_ids"] == [] and doc["skipped"] == {}
    assert doc["torch_threads"] == 1 and doc["max_new_tokens"] == NEW
    assert set(doc["results"]) == set(peer_hf.PEER_METHODS)
    for m, r in doc["results"].items():
        assert r["tokens"] == 2 * NEW, m  # EOS ignored: exactly the budget
        assert _finite_positive(r["seconds"]) and r["tok_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert r["identical_to_hf_greedy"] is True, m  # prompt lookup and assisted decoding are exact
    md = _md_rows((out / "peer_hf.md").read_text())
    assert [c[0] for c in md] == list(doc["results"])


def test_peer_hf_without_assistant_says_so(tiny_dir):
    from benchmarks.peer_hf import HFPeer

    peer = HFPeer(tiny_dir, [2], None, prompt_lookup_tokens=2, torch_threads=1)
    assert peer.methods == ["hf_greedy", "hf_prompt_lookup"] and "--assistant" in peer.skipped["hf_assisted"]
    assert peer.model.generation_config.eos_token_id == [2] and peer.model.generation_config.pad_token_id == 2
    assert peer._kwargs("hf_prompt_lookup") == {"prompt_lookup_num_tokens": 2}
    with pytest.raises(ValueError):
        peer._kwargs("hf_medusa")
    prompt = [1, 20, 30, 40]
    toks, dt = peer.generate("hf_greedy", prompt, NEW)
    assert 1 <= len(toks) <= NEW and dt > 0
    # cut after the first EOS, which is kept
    assert 2 not in toks[:-1]


def test_compile_cost_reports_every_program_at_every_depth(tmp_path, capsys):
    from benchmarks import compile_cost

    summary = compile_cost.main(["--shape", "tiny-moe", "--layers", "1", "2", "--programs", "plain", "peagle",
                                 "--peagle-layers", "1", "--context", "64", "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    for layers in (1, 2):
        for program in ("plain", "peagle"):
            assert any(line.startswith(f"COMPILE_S layers={layers} program={program} seconds=") for line in lines)
    rows = {(r["layers"], r["program"]): r for r in summary["rows"]}
    # A deeper model computes more and compiles more instructions; a K=7 round computes more than a step.
    for program in ("plain", "peagle"):
        assert rows[2, program]["flops"] > rows[1, program]["flops"] > 0
        assert rows[2, program]["fusions"] > rows[1, program]["fusions"] > 0
    assert rows[1, "peagle"]["flops"] > rows[1, "plain"]["flops"]
    assert (tmp_path / "compile_cost.md").read_text().count("| peagle |") == 2


def test_compile_cost_of_a_scanned_target_does_not_grow_with_depth(tmp_path):
    from benchmarks import compile_cost

    summary = compile_cost.main(["--shape", "tiny-moe", "--layers", "2", "4", "--programs", "plain",
                                 "--layer-loop", "scan", "--moe", "grouped", "--context", "64", "--out", str(tmp_path)])
    two, four = summary["rows"]  # (one layer would be a loop XLA removes)
    assert two["hlo_ops"] == four["hlo_ops"] > 0 and two["fusions"] == four["fusions"]
    assert "loop body counted once" in (tmp_path / "compile_cost.md").read_text()


@pytest.mark.slow
def test_weights_quality_and_prefill_decode_on_the_default_model(tmp_path):
    """The default model's Q4_1 file through both weight paths: the file's blocks score against
    the float32 dequantized model, and both paths report prefill and decode speeds."""
    from benchmarks import prefill_decode, weights_quality

    quality = weights_quality.main(["--limit", "1", "--tokens", "8", "--out", str(tmp_path / "q")])
    rows = {(r["target_weights"], r["domain"]): r for r in quality["results"]}
    assert set(rows) == {(w, d) for w in ("file", "bf16") for d in ("code", "chat")}
    assert all(r["tokens"] == 8 and 0.5 <= r["greedy_agreement"] <= 1 and r["logit_rms_error"] > 0
               for r in rows.values())
    speed = prefill_decode.main(["--limit", "1", "--batch-sizes", "1", "2", "--tokens", "5",
                                 "--out", str(tmp_path / "s")])
    assert [r["weights"] for r in speed["results"]] == ["file", "bf16"]
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s_b2"] > 0 for r in speed["results"])
    assert (tmp_path / "s" / "prefill_decode.md").is_file() and (tmp_path / "q" / "weights_quality.md").is_file()

"""benchmarks.learning_curve end to end on a tiny random target and a hand-made generate_data
folder: features once, two budgets trained, exported and evaluated on held-out prompts, the
table and the PNG written, and a rerun resumes from the evaluations already done; then the
one-run curve over a run's exported checkpoints."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import yaml

from benchmarks import learning_curve
from peagle_jax.train.shards import Record, write_shard

pytestmark = pytest.mark.slow  # seven subprocesses, each importing jax: about two minutes


def test_curve_trains_each_budget_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    for split, n in (("train", 24), ("val", 4)):
        write_shard(data, split, [Record(f"{split}{i}", "math", 1, rng.integers(1, 60, 6).tolist(),
                                         rng.integers(1, 60, 20).tolist()) for i in range(n)], 64)
    config = {"run_dir": str(tmp_path / "runs" / "tiny"), "batch_size": 4,
              "model": {"random_target": dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=8, max_position_embeddings=256)},
              "data": {"source": "generated", "generated_dir": str(data), "seq_len": 32,
                       "features_dir": str(tmp_path / "features"), "shard_tokens": 200},
              "objective": {"method": "peagle", "num_depths": 3, "max_anchors": 16},
              "optim": {"total_steps": 6, "warmup_steps": 1}, "checkpoint_every": 100, "eval_every": 100}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config))
    argv = ["--config", "tiny.yaml", "--tokens", "100", "all", "--num-draft-tokens", "3", "--prompts", "2",
            "--max-new-tokens", "8", "--min-steps", "2", "--out", "curve"]
    assert learning_curve.main(argv) == 0
    summary = json.loads((tmp_path / "curve" / "learning_curve.json").read_text())
    assert [r["docs"] for r in summary["rows"]] == [5, 24]  # 5 answers of 20 tokens hold the first 100
    assert [r["steps"] for r in summary["rows"]] == [2, 6]
    assert all(1.0 <= r["mean_acceptance_length"] <= 4.0 for r in summary["rows"])
    assert (tmp_path / "curve" / "learning_curve.png").stat().st_size > 1000
    assert "| 100 | 5 | 2 |" in (tmp_path / "curve" / "learning_curve.md").read_text()
    # a rerun finds both evaluations and trains nothing
    calls = []
    monkeypatch.setattr(learning_curve, "run", lambda cmd, log: calls.append(cmd[2]) or "")
    assert learning_curve.main(argv) == 0
    assert calls == ["peagle_jax.train.features"]

    # the one-run curve: heads exported from a run's checkpoints, evaluated, tokens from its metrics
    run_dir = tmp_path / "runs" / "tiny_curve" / "all"
    monkeypatch.undo()  # the real `run` again
    monkeypatch.chdir(tmp_path)
    heads = tmp_path / "heads"
    learning_curve.run([sys.executable, "-m", "peagle_jax.train.export", "--run_dir",
                        str(run_dir), "--out", str(heads / "step_6"), "--layout", "aws", "--step", "6"],
                       tmp_path / "export.log")
    one = ["--config", "tiny.yaml", "--checkpoints", str(heads), "--num-draft-tokens", "3", "--prompts", "2",
           "--max-new-tokens", "8", "--out", "one", f"run_dir={run_dir}"]
    assert learning_curve.main(one) == 0
    summary = json.loads((tmp_path / "one" / "learning_curve.json").read_text())
    seen = sum(json.loads(line)["tokens"] for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    (row,) = summary["rows"]
    assert row["steps"] == 6 and row["document_tokens"] == round(seen)
    assert row["answer_tokens"] == round(seen * 20 / 26)  # prompts of 6 tokens, answers of 20
    assert 1.0 <= row["mean_acceptance_length"] <= 4.0
    assert (heads / "step_6.evaluate.json").exists()
    assert "one run" in (tmp_path / "one" / "learning_curve.md").read_text()

"""peagle_jax.train.manifest: what `manifest.json` records about a head and its run."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from tiny_train_run import tiny_config, write_features

from peagle_jax.train import manifest
from peagle_jax.train.train import Trainer


def _records(n: int) -> list[dict]:
    """Metrics lines as the loop writes them: step i has loss i, lr 1/i, 0.5 s, 100 tokens; depth 1's
    accuracy is missing (None: no chain reached it) on even steps, depth 2's on every step."""
    return [{"step": i, "loss": float(i), "lr": 1.0 / i, "step_time": 0.5, "tokens": 100.0,
             "acc": [i / 100, None if i % 2 == 0 else i / 200, None]} for i in range(1, n + 1)]


def _write_metrics(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" + ("\n" if r["step"] == 3 else "") for r in recs))  # a blank line too


@pytest.mark.filterwarnings("ignore:Mean of empty slice")  # depth 2: no accuracy in any record
def test_training_summary_hand_computed(tmp_path):
    _write_metrics(tmp_path / "metrics.jsonl", _records(12))
    s = manifest.training_summary(tmp_path)
    # all 12 steps for time and tokens; the last 10 (steps 3..12) for loss and accuracy
    assert s["steps"] == 12 and s["wall_time_s"] == 6.0 and s["tokens_seen"] == 1200
    assert s["final_loss"] == 7.5  # mean(3..12)
    assert s["final_lr"] == pytest.approx(1 / 12)
    # depth 0: mean(3..12) / 100; depth 1: odd steps 3, 5, ..., 11 only -> 7 / 200; depth 2: none
    assert s["final_train_acc_per_depth"] == [0.075, 0.035, None]

    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        manifest.training_summary(tmp_path)


def test_sha256_file_reads_in_blocks(tmp_path):
    data = np.random.default_rng(0).bytes((5 << 20) // 2 + 3)  # 2.5 MiB + 3: three 1 MiB blocks
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    assert manifest.sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    assert manifest.sha256_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run over its own self-distilled shards plus an extra corpus folder, checkpointed at step
    12 (the weights are the initial ones: the manifest reads the run, training would only cost a
    compile), with 12 hand-written metrics lines."""
    tmp = tmp_path_factory.mktemp("manifest")
    extra = tmp / "corpus_feat" / "train"
    cfg = tiny_config(tmp, **{"data.extra_train_features": [str(extra)]})
    write_features(cfg.features_dir / "train", [20, 12, 9, 30], source="selfdistill", seed=0)
    write_features(extra, [25, 7], source="code", seed=2)
    write_features(cfg.features_dir / "val", [15, 11], source="selfdistill", seed=1)
    tr = Trainer(cfg, log=lambda *_: None)
    tr.step = 12
    tr.save()
    _write_metrics(tr.run_dir / "metrics.jsonl", _records(12))
    return cfg, tr, extra


@pytest.mark.filterwarnings("ignore:Mean of empty slice")
def test_manifest_cli_records_the_run_and_the_head(run, tmp_path, capsys):
    cfg, tr, extra = run
    head = tmp_path / "head"
    head.mkdir()
    weights = np.random.default_rng(1).bytes(1_500_000)
    (head / "model.safetensors").write_bytes(weights)
    (head / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (head / "manifest.json").write_text("stale")  # replaced, and never listed among the files
    (tmp_path / "extra.json").write_text(json.dumps({"acceptance": {"mean_acceptance_length": 1.5}}))
    command = "python -m peagle_jax.train.train --config configs/train/tiny.yaml max_steps=12"

    capsys.readouterr()
    manifest.main(["--run_dir", cfg.run_dir, "--head", str(head), "--command", command, "--val_batches", "2",
                   "--extra", str(tmp_path / "extra.json")])
    m = json.loads((head / "manifest.json").read_text())

    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", m["created"])
    assert m["command"] == command and m["method"] == "peagle" and m["target"] == "default"
    assert m["drafter"] == {"num_layers": 1, "draft_vocab_size": 48, "num_depths": 3, "mask_token_id": None,
                            "train_embed": "none"}
    assert m["config"] == json.loads(json.dumps(cfg.model_dump()))
    # data: 4 own documents (71 tokens) + 2 extra ones (32 tokens); 2 held out (26 tokens)
    d = m["data"]
    assert (d["source"], d["features_dir"]) == ("selfdistill", str(cfg.features_dir))
    assert (d["train_documents"], d["train_tokens"], d["val_documents"], d["val_tokens"]) == (6, 103, 2, 26)
    assert "self-distillation" in d["description"]
    assert [(p["folder"], p["source"], p["documents"], p["tokens"]) for p in d["train_parts"]] == [
        (str(cfg.features_dir / "train"), "selfdistill", 4, 71), (str(extra), "code", 2, 32)]
    assert d["train_parts"][0]["description"] == d["description"]
    assert d["train_parts"][1]["description"].startswith("Python standard library .py files")
    # training: the metrics' summary; held out: the training objective on 2 validation batches
    assert m["training"] == manifest.training_summary(tr.run_dir)
    assert m["training"]["steps"] == 12
    want = tr.evaluate(2)
    assert m["held_out"] == {"val_batches": 2, "val_loss": round(want["val_loss"], 4),
                             "val_acc_per_depth": [None if a is None else round(a, 4) for a in want["val_acc"]]}
    assert len(want["val_acc"]) == 3 and all(a is None or 0.0 <= a <= 1.0 for a in want["val_acc"])
    # every file but the manifest itself, with its sha256 and size
    assert m["files"] == {
        "config.json": {"sha256": hashlib.sha256((head / "config.json").read_bytes()).hexdigest(),
                        "bytes": (head / "config.json").stat().st_size},
        "model.safetensors": {"sha256": hashlib.sha256(weights).hexdigest(), "bytes": 1_500_000},
    }
    assert m["acceptance"] == {"mean_acceptance_length": 1.5}  # --extra merged in
    # stdout: the summary, as JSON
    assert json.loads(capsys.readouterr().out) == {k: m[k] for k in ("method", "training", "held_out")}


def test_cli_module_path():
    p = subprocess.run([sys.executable, "-m", "peagle_jax.train.manifest", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "usage: python -m peagle_jax.train.manifest" in p.stdout
    p = subprocess.run([sys.executable, "-m", "peagle_jax.train.manifest", "--run_dir", "x"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "--head" in p.stderr and "--command" in p.stderr

"""A run longer than a session: the trainable weights committed to a repository folder
(`state_dir`), and a run on a machine without the orbax checkpoints going on from them."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from peagle_jax.train import evaluate, manifest
from peagle_jax.train.committed import load_state, read_state_info, save_state
from peagle_jax.train.config import load_config
from peagle_jax.train.export import export, load_committed
from peagle_jax.train.train import Trainer

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256)


def _cfg(tmp_path, run: str, **changes):
    return load_config(None, {
        "run_dir": str(tmp_path / run), "batch_size": 4, "progress": False, "model": {"random_target": TINY},
        "data": {"source": "random", "seq_len": 32, "features_dir": str(tmp_path / "feat"), "random_docs": 32,
                 "random_new_tokens": 20},
        "objective": {"method": "peagle", "num_depths": 3, "max_anchors": 16},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "total_steps": 8}, "checkpoint_every": 1000,
        "state_dir": str(tmp_path / "repo" / "state_peagle"), "state_every": 3, **changes})


def test_a_fresh_machine_goes_on_from_the_committed_weights(tmp_path, capsys):
    first = Trainer(_cfg(tmp_path, "machine_a", max_steps=4))
    first.run()  # states at steps 3 and 4 (the last step)
    info = read_state_info(tmp_path / "repo" / "state_peagle")
    assert info["step"] == 4 and info["method"] == "peagle"
    assert all(s["bytes"] <= 20 * 2**20 for s in info["shards"])
    weights = {k: np.asarray(v) for k, v in first.trainable.items()}
    # machine B: no orbax checkpoint, the same repository folder
    second = Trainer(_cfg(tmp_path, "machine_b"))
    assert second.step == 4
    # the run's metrics travel with the state: machine B's run directory has steps 1..4
    carried = (tmp_path / "machine_b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in carried] == [1, 2, 3, 4]
    for k, v in second.trainable.items():  # the weights, rounded to bf16
        np.testing.assert_allclose(np.asarray(v), weights[k], rtol=2**-7, atol=1e-6)
    np.testing.assert_array_equal(second.draft_ids, first.draft_ids)
    assert 0 < float(second.sched(4)) < float(first.sched(4))  # a re-warm-up from the resumed step
    # `export --config` on machine C (no run directory): the head those committed weights make
    config = tmp_path / "peagle.yaml"
    config.write_text(yaml.safe_dump(_cfg(tmp_path, "machine_c").model_dump()))
    head, _, _, step = load_committed(config)
    assert step == 4
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(head)),
                 nnx.to_pure_dict(nnx.state(second.drafter())))
    recs = second.run()
    assert [r["step"] for r in recs] == [5, 6, 7, 8] and all(np.isfinite(r["loss"]) for r in recs)
    assert read_state_info(tmp_path / "repo" / "state_peagle")["step"] == 8
    # a head and its manifest from the committed state alone (machine C again)
    export(None, tmp_path / "head", layout="aws", dtype="float32", config=config)
    manifest.main(["--config", str(config), "--head", str(tmp_path / "head" / "aws"), "--command", "train ..."])
    made = json.loads((tmp_path / "head" / "aws" / "manifest.json").read_text())
    assert made["training"]["steps"] == 8 and made["held_out"] is None
    assert made["drafter"]["draft_vocab_size"] == len(first.draft_ids)
    assert set(made["files"]) == {"config.json", "model.safetensors"}
    # its held-out acceptance, from the committed state alone (machine C: `evaluate --config`)
    evaluate.main(["--config", str(config), "--prompts", "1", "--max_new_tokens", "4"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 8 and out["method"] == "peagle" and out["num_draft_tokens"] == 3
    assert 1.0 <= out["mean_acceptance_length"] <= 4.0


def test_a_damaged_or_foreign_state_is_refused(tmp_path):
    like = {"a/kernel": np.ones((4, 3), np.float32), "b": np.zeros(5, np.float32)}
    live = save_state(tmp_path, 7, like, {"method": "peagle"}, {"draft_ids.npy": np.arange(3)})
    assert load_state(tmp_path, like)[0] == 7 and (live / "draft_ids.npy").exists()
    with pytest.raises(ValueError, match=r"missing \['c'\]"):
        load_state(tmp_path, {**like, "c": np.ones(2)})
    shard = live / json.loads((live / "state.json").read_text())["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(ValueError, match="sha256"):
        load_state(tmp_path, like)


def test_export_names_a_config_without_a_committed_state(tmp_path, capsys):
    config = tmp_path / "peagle.yaml"
    config.write_text(yaml.safe_dump(_cfg(tmp_path, "run").model_dump()))
    with pytest.raises(FileNotFoundError, match="no committed state"):
        load_committed(config)
    with pytest.raises(SystemExit):  # evaluate says so too, as a usage error
        evaluate.main(["--config", str(config)])
    assert "no committed state" in capsys.readouterr().err

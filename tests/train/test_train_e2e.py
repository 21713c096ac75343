"""End to end on a tiny random target: the loss falls and the trained head's greedy acceptance
(P-EAGLE and EAGLE-3 TTT) beats an untrained head's (under a minute each on 2 CPU cores)."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors import safe_open

from peagle_jax.checkpoints.drafter_io import load_drafter
from peagle_jax.generate import speculative_generate
from peagle_jax.train.config import load_config
from peagle_jax.train.export import export
from peagle_jax.train.train import Trainer

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_train_end_to_end(tmp_path, method):
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "batch_size": 8, "progress": False,
        "model": {"random_target": TINY},
        "data": {"source": "random", "seq_len": 64, "features_dir": str(tmp_path / "feat"), "random_docs": 128,
                 "random_new_tokens": 40},
        "objective": {"method": method, "num_depths": 4, "max_anchors": 48, "ttt_steps": 3},
        "optim": {"lr": 3e-3, "warmup_steps": 10, "total_steps": 160}, "checkpoint_every": 1000,
    })
    tr = Trainer(cfg)
    untrained = tr.drafter()
    recs = tr.run()
    first = np.mean([r["loss"] for r in recs[:10]])
    last = np.mean([r["loss"] for r in recs[-10:]])
    assert last < 0.6 * first, (first, last)
    assert all(np.isfinite(r["loss"]) for r in recs)
    trained = tr.drafter()
    rng = np.random.default_rng(123)
    prompts = [rng.integers(1, 63, 4).tolist() for _ in range(8)]
    al = {}
    for name, d in (("untrained", untrained), ("trained", trained)):
        res = speculative_generate(tr.target, d, prompts, method=method, num_draft_tokens=3, max_new_tokens=40)
        al[name] = res.mean_acceptance_length
    assert al["trained"] > al["untrained"] + 0.3, al
    # the exported head (frozen embedding left out) reloads with the target's tensors; it carries
    # the draft-vocabulary lm_head (vLLM would substitute the full target lm_head without it)
    paths = export(cfg.run_dir, tmp_path / "export", layout="both", dtype="float32")
    for p in paths:
        with safe_open(p / "model.safetensors", "np") as f:
            head = f.get_tensor("lm_head.weight")
            draft_ids = np.arange(head.shape[0]) + f.get_tensor("d2t")
        np.testing.assert_array_equal(head, np.asarray(tr.target.lm_head_weight(), np.float32)[:, draft_ids].T)
        back = load_drafter(p, target=tr.target)
        res = speculative_generate(tr.target, back, prompts, method=method, num_draft_tokens=3, max_new_tokens=40)
        assert abs(res.mean_acceptance_length - al["trained"]) < 1e-6

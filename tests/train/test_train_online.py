"""`data.features: online`: the target runs inside the training step over packed rows, and each
element gets the features that extraction to disk gives it (a forward over its document alone)."""

from __future__ import annotations

import numpy as np
import pytest

from peagle_jax.train.config import load_config
from peagle_jax.train.data import PackPlan, pack_row, raw_row
from peagle_jax.train.train import Trainer, online_rows

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256)


def _cfg(tmp_path, features: str):
    return load_config(None, {
        "run_dir": str(tmp_path / features / "run"), "batch_size": 2, "progress": False,
        "model": {"random_target": TINY},
        "data": {"source": "random", "seq_len": 48, "features": features, "features_dir": str(tmp_path / "feat"),
                 "feature_dtype": "float32", "random_docs": 16, "random_new_tokens": 9},
        "objective": {"method": "peagle", "num_depths": 3, "max_anchors": 8},
        "optim": {"warmup_steps": 1, "total_steps": 4},
    })


def test_raw_row_lays_out_the_packed_documents_whole():
    docs = [np.array([5, 6, 7, 8]), np.array([9, 10, 11])]
    raw = raw_row(8, docs, max_docs=3)
    np.testing.assert_array_equal(raw.tokens, [5, 6, 7, 8, 9, 10, 11, 0, 0, 0, 0])
    np.testing.assert_array_equal(raw.positions, [0, 1, 2, 3, 0, 1, 2, 0, 0, 0, 0])
    np.testing.assert_array_equal(raw.start, [0, 0, 0, 0, 4, 4, 4, 7, 8, 9, 10])
    # pack_row's elements: x1 x2 x3 | x1 x2 of the second document; their taps sit at raw 0 1 2 | 4 5
    tokens = pack_row(8, [(d, np.ones(len(d)), None, None) for d in docs], 0, 0)[0]
    np.testing.assert_array_equal(tokens[:5], [6, 7, 8, 10, 11])
    np.testing.assert_array_equal(raw.elem_index[:5], [0, 1, 2, 4, 5])
    with pytest.raises(ValueError, match="room for 1"):
        raw_row(8, docs, max_docs=1)


def test_pack_plan_caps_the_documents_a_row_holds():
    lengths = [4] * 40
    rows = PackPlan(lengths, seq_len=48, seed=0, max_docs=5).epoch_rows(0)
    assert max(len(r) for r in rows) == 5
    assert sorted(i for r in rows for i in r) == list(range(40))
    assert max(len(r) for r in PackPlan(lengths, seq_len=48, seed=0).epoch_rows(0)) == 16
    with pytest.raises(ValueError, match="max_docs"):
        PackPlan(lengths, seq_len=48, seed=0, max_docs=0)


@pytest.mark.parametrize("split", ["train", "val"])
def test_online_rows_equal_the_features_extracted_to_disk(tmp_path, split):
    disk, online = Trainer(_cfg(tmp_path, "disk"), log=lambda *_: None), Trainer(_cfg(tmp_path, "online"),
                                                                                  log=lambda *_: None)
    host_d, b = disk.host_rows(0, split)
    host_o, _ = online.host_rows(0, split)
    for key in ("tokens", "positions", "doc", "loss_mask"):  # the same packed rows, short documents together
        np.testing.assert_array_equal(host_d[key], host_o[key])
    assert (host_d["doc"].max(axis=1) >= 2).all()  # three or more documents a row
    rows_d, _ = disk.device_rows(host_d, b)
    rows_o, raw = online.device_rows(host_o, b)
    filled = online_rows(online.target_graphdef, online.target_state, raw, rows_o)
    real = host_d["doc"] >= 0
    np.testing.assert_allclose(np.asarray(filled.aux)[real], np.asarray(rows_d.aux)[real], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(filled.target_hidden)[real], np.asarray(rows_d.target_hidden)[real],
                               atol=2e-5, rtol=2e-5)


def test_an_online_run_trains(tmp_path):
    tr = Trainer(_cfg(tmp_path, "online"), log=lambda *_: None)
    recs = tr.run()
    assert len(recs) == 4 and all(np.isfinite(r["loss"]) for r in recs)

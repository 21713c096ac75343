"""Data pipeline: draft vocabulary, deterministic packing and the EAGLE shift, chat loss masks."""

from __future__ import annotations

import numpy as np
import pytest

from peagle_jax.train.data import Doc, PackPlan, chat_tokens, chunk_doc, is_validation, pack_row, stdlib_files
from peagle_jax.train.vocab import draft_ids_from_counts, token_counts, vocab_maps


def test_draft_vocab_top_counts_sorted_with_forced_ids():
    counts = token_counts([(np.array([5, 5, 5, 9, 9, 2, 7]), np.array([1, 1, 1, 1, 1, 1, 0]))], 12)
    assert counts[5] == 3 and counts[7] == 0
    ids = draft_ids_from_counts(counts, 4, always=[11])
    assert ids.tolist() == [2, 5, 9, 11]
    ids = draft_ids_from_counts(counts, 5)  # pads with the lowest unseen ids
    assert ids.tolist() == [0, 1, 2, 5, 9]
    d2t, t2d = vocab_maps(ids, 12)
    assert (np.arange(5) + d2t).tolist() == ids.tolist() and t2d.sum() == 5 and t2d[ids].all()
    assert draft_ids_from_counts(counts, None).tolist() == list(range(12))


def test_pack_plan_deterministic_and_shift():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 20, 30).tolist()
    a, b = PackPlan(lengths, 24, seed=5), PackPlan(lengths, 24, seed=5)
    rows = [a.row(i) for i in range(3 * a.rows_per_epoch())]
    assert rows == [b.row(i) for i in range(len(rows))]
    assert a.epoch_rows(0) != a.epoch_rows(1)  # reshuffled per epoch
    for e in range(2):
        flat = sorted(i for r in a.epoch_rows(e) for i in r)
        assert flat == list(range(30))  # every document once per epoch
        assert all(sum(lengths[i] - 1 for i in r) <= 24 for r in a.epoch_rows(e))
    # first fit: a later document fills an earlier row's room, so no row could take another's
    # first document (rows are created only when none has room)
    rows0 = a.epoch_rows(0)
    used = [sum(lengths[i] - 1 for i in r) for r in rows0]
    for k, r in enumerate(rows0):
        assert all(used[j] + lengths[r[0]] - 1 > 24 for j in range(k))
    assert [len(r) for r in PackPlan(lengths, 24, seed=5, max_docs=1).epoch_rows(0)] == [1] * 30
    d0 = (np.array([10, 11, 12, 13]), np.array([0, 1, 1, 1]), np.arange(8).reshape(4, 2) * 1.0,
          np.arange(4)[:, None] * 1.0)
    d1 = (np.array([20, 21, 22]), np.array([0, 0, 1]), np.ones((3, 2)), np.full((3, 1), 7.0))
    t, lm, pos, doc, aux, fh = pack_row(8, [d0, d1], 2, 1)
    assert t.tolist() == [11, 12, 13, 21, 22, 0, 0, 0]  # x_{i+1}
    assert lm.tolist() == [1, 1, 1, 0, 1, 0, 0, 0]  # l_{i+1}
    assert pos.tolist() == [0, 1, 2, 0, 1, 0, 0, 0] and doc.tolist() == [0, 0, 0, 1, 1, -1, -1, -1]
    assert aux[:3].tolist() == [[0, 1], [2, 3], [4, 5]]  # g_i (unshifted)
    assert fh[:5, 0].tolist() == [1, 2, 3, 7, 7]  # final hidden at i+1
    assert [len(c.tokens) for c in chunk_doc(Doc(np.arange(11), np.ones(11, np.uint8)), 4)] == [4, 4, 3]


def test_stdlib_split_is_deterministic_and_disjoint():
    files = [rel for rel, _ in stdlib_files()]
    assert files == sorted(files) and len(files) > 500
    assert not any("site-packages" in f for f in files)
    val = [f for f in files if is_validation(f, 2.0)]
    assert 0 < len(val) < 0.05 * len(files)


def test_chat_loss_mask_covers_assistant_only():
    from peagle_jax.checkpoints.default_model import default_model_path
    from peagle_jax.checkpoints.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(default_model_path())
    except FileNotFoundError:
        pytest.skip("default model not installed")
    msgs = [{"role": "user", "content": "Add two numbers."},
            {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "You're welcome."}]
    d = chat_tokens(tok, msgs)
    learned = tok.decode(d.tokens[d.loss_mask.astype(bool)])
    assert "return a + b" in learned and "welcome" in learned
    assert "Add two" not in learned and "Thanks" not in learned and "user" not in learned


def test_code_window_per_file_spreads_budget():
    from peagle_jax.train.data import code_docs, is_test_file

    class Tok:  # one token per character: windows are easy to check against the file text
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 50000 for c in text]}

    whole = code_docs(Tok(), split="train", val_percent=2.0, max_docs=30, eos_id=None, skip_tests=True)
    cut = code_docs(Tok(), split="train", val_percent=2.0, max_docs=30, eos_id=None, tokens_per_file=64,
                    skip_tests=True)
    assert [d.name for d in whole] == [d.name for d in cut]
    assert not any(is_test_file(d.name) for d in cut)
    for w, c in zip(whole, cut, strict=True):
        assert len(c.tokens) == min(64, len(w.tokens))
        # the window is a contiguous slice of the file, at an offset fixed by the name
        s = "".join(map(chr, w.tokens)).find("".join(map(chr, c.tokens)))
        assert s >= 0
    assert is_test_file("test/test_os.py") and is_test_file("idlelib/idle_test/x.py")
    assert is_test_file("test_foo.py") and not is_test_file("json/decoder.py")


def test_concat_store_reads_several_feature_folders(tmp_path):
    from peagle_jax.train.config import load_config
    from peagle_jax.train.features import ConcatStore, FeatureStore, _write_shard, open_train_store

    def folder(name, lengths, target="t"):
        root = tmp_path / name
        root.mkdir()
        rng = np.random.default_rng(len(name))
        docs = [Doc(rng.integers(0, 9, n).astype(np.int32), np.ones(n, np.uint8), f"{name}{i}")
                for i, n in enumerate(lengths)]
        aux = [rng.normal(size=(n, 6)) for n in lengths]
        hid = [rng.normal(size=(n, 2)) for n in lengths]
        shard = _write_shard(root, 0, 0, docs, aux, hid, "float32")
        (root / "meta.json").write_text(__import__("json").dumps(
            {"complete": True, "num_docs": len(docs), "shards": [shard], "dtype": "float32",
             "aux_dim": 6, "hidden_dim": 2, "target": target}))
        return root, docs

    a, da = folder("a", [5, 7])
    b, db = folder("bb", [3])
    cfg = load_config(None, {"run_dir": str(tmp_path / "r"), "data": {"extra_train_features": [str(b)]}})
    st = open_train_store(cfg, a)
    assert isinstance(st, ConcatStore) and len(st) == 3 and st.lengths() == [5, 7, 3]
    np.testing.assert_array_equal(st.get(2)[0], db[0].tokens)
    np.testing.assert_array_equal(st.get(1)[0], da[1].tokens)
    c, _ = folder("c", [4], target="other")
    with pytest.raises(ValueError, match="different targets"):
        ConcatStore([FeatureStore(a), FeatureStore(c)])
    bad = load_config(None, {"run_dir": str(tmp_path / "r"),
                             "data": {"extra_train_features": [str(tmp_path / "nope")]}})
    with pytest.raises(FileNotFoundError, match="extra_train_features"):
        open_train_store(bad, a)


def test_capped_runs_read_a_prefix_of_features_extracted_once(tmp_path):
    """A learning curve extracts features once, without `data.max_docs`; a capped run then reads
    the first documents of that store, and a capped extraction is extended when a later run
    reads more."""
    from peagle_jax.train.config import load_config
    from peagle_jax.train.features import FeatureStore, ensure_features
    from peagle_jax.train.shards import Record, write_shard

    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    for split, n in (("train", 12), ("val", 3)):
        recs = [Record(f"{split}{i}", "math", 1, rng.integers(1, 60, 5).tolist(), rng.integers(1, 60, 9).tolist())
                for i in range(n)]
        write_shard(data, split, recs, 64)
    base = {"run_dir": str(tmp_path / "run"), "model": {"random_target": dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256)},
        "data": {"source": "generated", "generated_dir": str(data), "seq_len": 32, "features_dir": str(tmp_path / "f"),
                 "shard_tokens": 40}}
    cfg = lambda **data_changes: load_config(None, {**base, "data": {**base["data"], **data_changes}})
    paths, limits = ensure_features(cfg(max_docs=4), log=lambda *_: None)  # capped first: 4 documents
    assert limits["train"] == 4 and len(FeatureStore(paths["train"])) == 4
    paths, limits = ensure_features(cfg(), log=lambda *_: None)  # all: the capped store is extended
    full = FeatureStore(paths["train"])
    assert limits["train"] is None and len(full) == 12
    paths, limits = ensure_features(cfg(max_docs=7), log=lambda *_: None)  # nothing extracted again
    capped = FeatureStore(paths["train"], limits["train"])
    assert len(capped) == 7
    for i in (0, 6):
        np.testing.assert_array_equal(capped.get(i)[2], full.get(i)[2])
    with pytest.raises(ValueError, match="fewer than the 13"):
        FeatureStore(paths["train"], 13)

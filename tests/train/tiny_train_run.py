"""A tiny training run directory for the tests of the tools that read one (evaluate, manifest).

Feature shards are written by hand (known documents, random taps) instead of being extracted
from the target, and the run is checkpointed without training: what those tools read is the
run directory's layout, not how good the weights are, and this keeps the setup to seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from peagle_jax.models import ModelConfig
from peagle_jax.train.config import TrainConfig, load_config
from peagle_jax.train.data import Doc

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256)


def write_features(root: Path, lengths: list[int], *, source: str, seed: int) -> list[Doc]:
    """A complete feature folder of documents with these lengths (as `extract_to_disk` leaves it)."""
    from peagle_jax.train.features import _write_shard

    mc = ModelConfig(**{"architecture": "llama", **TINY})
    aux_dim = mc.hidden_size * len(mc.eagle_aux_layer_ids)
    rng = np.random.default_rng(seed)
    docs = [Doc(rng.integers(1, TINY["vocab_size"], n).astype(np.int32), np.ones(n, np.uint8), f"{source}{i}")
            for i, n in enumerate(lengths)]
    aux = [rng.normal(size=(n, aux_dim)) for n in lengths]
    hid = [rng.normal(size=(n, mc.hidden_size)) for n in lengths]
    root.mkdir(parents=True)
    shard = _write_shard(root, 0, 0, docs, aux, hid, "float32")
    (root / "meta.json").write_text(json.dumps({
        "complete": True, "num_docs": len(docs), "shards": [shard], "dtype": "float32", "aux_dim": aux_dim,
        "hidden_dim": mc.hidden_size, "source": source, "target": "random"}))
    return docs


def tiny_config(tmp: Path, **over) -> TrainConfig:
    base = {
        "run_dir": str(tmp / "run"), "batch_size": 2, "progress": False, "seed": 3,
        "model": {"random_target": TINY},
        "data": {"source": "selfdistill", "seq_len": 32, "features_dir": str(tmp / "feat")},
        "drafter": {"draft_vocab_size": 48},
        "objective": {"method": "peagle", "num_depths": 3, "max_anchors": 8},
        "optim": {"warmup_steps": 1, "total_steps": 10},
    }
    for k, v in over.items():
        node = base
        *parents, last = k.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return load_config(None, base)

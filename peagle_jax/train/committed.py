"""A training run's weights kept in the repository, so that a run longer than a session goes on
from where the last one stopped on a fresh machine (`TrainConfig.state_dir`).

The orbax checkpoints of `run_dir` hold everything (the optimizer's moments too, 3x the
weights) but live outside the repository, which a new machine does not have. Every
`state_every` steps the trainer also writes the trainable weights here, in bf16, as compressed
shards of at most 20 MB with a `state.json` (the step, the shards' sha256, what the run is), and
`state_commit` commits them. A run that finds no orbax checkpoint starts from this state: the
same weights (rounded to bf16), the same data position (a step's rows are a function of the step),
the learning-rate schedule where it was, and fresh optimizer moments under a short re-warm-up.

A new state is written beside the old one and swapped in by renames, so an interrupted write
never replaces a good state.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from peagle_jax.checkpoints.known_models import file_sha256
from peagle_jax.train.shards import MAX_SHARD_BYTES

STATE = "state"
METRICS = "metrics.jsonl.gz"
DRAFT_IDS = "draft_ids.npy"  # the draft vocabulary the weights were trained with, beside them


def save_state(folder: str | Path, step: int, trainable: dict[str, np.ndarray], about: dict,
               arrays: dict[str, np.ndarray] | None = None, metrics: str | None = None) -> Path:
    """Write `trainable` ({key: array}) in bf16 as `folder/state/`, with `arrays` ({file name:
    array}, e.g. the draft vocabulary) beside them as .npy files and `metrics` (the run's
    metrics.jsonl text, gzipped: a manifest reads it on a machine without the run directory);
    swapped in atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{STATE}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    shards, group, size = [], {}, 0

    def flush():
        nonlocal group, size
        if group:
            path = tmp / f"weights-{len(shards):05d}.npz"
            np.savez_compressed(path, **group)
            shards.append({"file": path.name, "bytes": path.stat().st_size, "sha256": file_sha256(path),
                           "keys": sorted(group)})
            group, size = {}, 0

    for key in sorted(trainable):
        bits = np.asarray(trainable[key], np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
        if bits.nbytes > MAX_SHARD_BYTES:
            raise ValueError(f"{key} is {bits.nbytes / 2**20:.0f} MB in bf16, more than one shard may hold")
        if size + bits.nbytes > MAX_SHARD_BYTES:
            flush()
        group[key.replace("/", ".")] = bits  # npz names cannot hold "/"
        size += bits.nbytes
    flush()
    for name, arr in (arrays or {}).items():
        np.save(tmp / name, arr)
    if metrics is not None:
        (tmp / METRICS).write_bytes(gzip.compress(metrics.encode(), mtime=0))
    (tmp / "state.json").write_text(json.dumps({"step": step, "dtype": "bfloat16", "shards": shards, **about},
                                               indent=1) + "\n")
    live, old = folder / STATE, folder / f".{STATE}.old"
    shutil.rmtree(old, ignore_errors=True)
    if live.exists():
        os.replace(live, old)
    os.replace(tmp, live)
    shutil.rmtree(old, ignore_errors=True)
    return live


def read_state_info(folder: str | Path | None) -> dict | None:
    """The `state.json` of a committed state, or None where there is none."""
    if folder is None or not (Path(folder) / STATE / "state.json").exists():
        return None
    return json.loads((Path(folder) / STATE / "state.json").read_text())


def load_state(folder: str | Path, like: dict[str, np.ndarray]) -> tuple[int, dict[str, np.ndarray]]:
    """(step, weights as float32 with `like`'s keys and shapes). A missing, extra or mis-shaped
    weight, or a shard whose bytes are not the ones recorded, is an error naming it."""
    root = Path(folder) / STATE
    info = json.loads((root / "state.json").read_text())
    out: dict[str, np.ndarray] = {}
    for shard in info["shards"]:
        path = root / shard["file"]
        if file_sha256(path) != shard["sha256"]:
            raise ValueError(f"{path}: its sha256 is not the one state.json records (a damaged or partial copy)")
        with np.load(path) as z:
            for name in z.files:
                out[name.replace(".", "/")] = z[name].view(ml_dtypes.bfloat16).astype(np.float32)
    missing = sorted(set(like) - set(out))
    extra = sorted(set(out) - set(like))
    shapes = sorted(k for k in set(like) & set(out) if tuple(np.shape(like[k])) != out[k].shape)
    if missing or extra or shapes:
        raise ValueError(f"{root} does not fit this run's head: missing {missing}, unexpected {extra}, "
                         f"other shapes {shapes}")
    return int(info["step"]), out


def read_metrics(folder: str | Path | None) -> str | None:
    """The metrics.jsonl text a committed state carries (None: none, e.g. a state written before
    states carried them)."""
    path = None if folder is None else Path(folder) / STATE / METRICS
    if path is None or not path.exists():
        return None
    return gzip.decompress(path.read_bytes()).decode()


def draft_ids_file(folder: str | Path) -> Path:
    """Where a committed state keeps its draft vocabulary (written by `save_state`'s arrays)."""
    return Path(folder) / STATE / DRAFT_IDS


def load_trainable(folder: str | Path, trainable: dict) -> tuple[int, dict]:
    """(step, `trainable` with the committed weights, each in its own dtype): `load_state` for
    a head's trainable parameters (a dict of jax arrays)."""
    import jax
    import jax.numpy as jnp

    step, weights = load_state(folder, jax.device_get(trainable))
    return step, {k: jnp.asarray(weights[k], v.dtype) for k, v in trainable.items()}

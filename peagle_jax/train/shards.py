"""Self-distilled conversations as compact shards that are committed to the repository.

Run folders outside the repository do not survive between sessions (two data runs were lost
that way, docs/training.md), so generated data lives in ``data/selfdistill/<model>/``:

  <split>-NNNNN.npz   one shard: token ids of prompt + answer per record, compressed
                      (uint16 when the vocabulary fits, else uint32), at most ~20 MB;
  manifest.json       generator settings, the target file's sha256, tokens per domain, and
                      one entry per shard (records, tokens, sha256), rebuilt from the shards.

A shard is written to a temporary file, read back, and renamed into place, so a killed writer
leaves either the whole shard or none of it. Features are never stored: they are recomputed
from these tokens (`train.features`).
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from peagle_jax.checkpoints.known_models import file_sha256

__all__ = ["MAX_SHARD_BYTES", "Record", "git_commit", "read_records", "read_split", "shard_paths", "write_manifest",
           "write_shard"]

MAX_SHARD_BYTES = 20 * 2**20
_SHARD = re.compile(r"^(train|val)-(\d{5})\.npz$")


@dataclass(frozen=True)
class Record:
    """One answered turn: the prompt's ids (chat template included) and the target's answer."""

    name: str
    domain: str
    turn: int
    prompt: Sequence[int]
    response: Sequence[int]


def shard_paths(folder: Path, split: str) -> list[Path]:
    """The complete shards of a split, in order (temporary files are not shards)."""
    if not folder.is_dir():
        return []
    found = sorted(p for p in folder.iterdir() if (m := _SHARD.match(p.name)) and m.group(1) == split)
    return found


def _encode(records: Sequence[Record], vocab_size: int) -> bytes:
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    tokens = np.concatenate([np.asarray([*r.prompt, *r.response], np.int64) for r in records])
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got {tokens.min()}..{tokens.max()}")
    buf = io.BytesIO()
    np.savez_compressed(
        buf,
        tokens=tokens.astype(dtype),
        prompt_lens=np.asarray([len(r.prompt) for r in records], np.uint32),
        response_lens=np.asarray([len(r.response) for r in records], np.uint32),
        turns=np.asarray([r.turn for r in records], np.uint8),
        names=np.asarray([r.name for r in records], np.str_),
        domains=np.asarray([r.domain for r in records], np.str_),
    )
    return buf.getvalue()


def _decode(raw: bytes | Path) -> list[Record]:
    with np.load(io.BytesIO(raw) if isinstance(raw, bytes) else raw, allow_pickle=False) as z:
        tokens, plens, rlens = z["tokens"].astype(np.int64), z["prompt_lens"], z["response_lens"]
        turns, names, domains = z["turns"], z["names"], z["domains"]
    if int(plens.sum() + rlens.sum()) != tokens.size:
        raise ValueError("shard lengths do not add up to its token count")
    out, at = [], 0
    for name, domain, turn, p, r in zip(names, domains, turns, plens, rlens, strict=True):
        ids = tokens[at : at + p + r].tolist()
        out.append(Record(str(name), str(domain), int(turn), ids[:p], ids[p:]))
        at += p + r
    return out


def write_shard(folder: Path, split: str, records: Sequence[Record], vocab_size: int) -> Path:
    """Write the next shard of `split` atomically; returns its path. Refuses a shard over
    MAX_SHARD_BYTES (write fewer records per shard) and one that does not read back equal."""
    if not records:
        raise ValueError("a shard needs at least one record")
    folder.mkdir(parents=True, exist_ok=True)
    existing = shard_paths(folder, split)
    index = 0 if not existing else int(_SHARD.match(existing[-1].name).group(2)) + 1
    path = folder / f"{split}-{index:05d}.npz"
    raw = _encode(records, vocab_size)
    if len(raw) > MAX_SHARD_BYTES:
        raise ValueError(f"a shard of {len(records)} records is {len(raw) / 2**20:.1f} MB, over the "
                         f"{MAX_SHARD_BYTES // 2**20} MB limit: write fewer records per shard")
    if _decode(raw) != [Record(r.name, r.domain, r.turn, list(r.prompt), list(r.response)) for r in records]:
        raise RuntimeError("a shard did not read back equal to its records")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def read_records(folder: Path, split: str) -> list[Record]:
    """Every record of a split's shards, in order."""
    out: list[Record] = []
    for p in shard_paths(folder, split):
        try:
            out.extend(_decode(p))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"shard {p} cannot be read ({e}); remove it to regenerate it") from e
    return out


def read_split(folder: Path, split: str) -> list[Record]:
    """Every record of a split's shards, in a fixed mixed order (a hash of each conversation
    turn's name) rather than the order runs wrote them: a run that rebalanced the folder
    (`generate_data --domains`) wrote one kind of answer only, and any prefix of the split
    (`data.max_docs`, the learning curve's budgets, the held-out prompts) should hold every
    domain in its share. FileNotFoundError, with the command that writes them, where the split
    has none."""
    if not shard_paths(folder, split):
        raise FileNotFoundError(f"{folder} holds no {split} shards; write them first with: python -m "
                                f"peagle_jax.train.generate_data --out {folder} --split {split}")
    return sorted(read_records(folder, split), key=lambda r: zlib.crc32(f"{r.name}/{r.turn}".encode()))


def summarize(records: Iterable[Record]) -> dict:
    """Conversations, answer and prompt tokens per domain, and the follow-up count."""
    conversations, answer_tokens, prompt_tokens = Counter(), Counter(), Counter()
    follow_ups = 0
    for r in records:
        conversations[r.domain] += r.turn == 1
        follow_ups += r.turn > 1
        answer_tokens[r.domain] += len(r.response)
        prompt_tokens[r.domain] += len(r.prompt)
    return {"conversations": dict(sorted(conversations.items())), "answer_tokens": dict(sorted(answer_tokens.items())),
            "prompt_tokens": dict(sorted(prompt_tokens.items())), "follow_ups": follow_ups,
            "total_answer_tokens": sum(answer_tokens.values())}


def write_manifest(folder: Path, header: dict) -> dict:
    """Rebuild manifest.json from the shards on disk and `header` (model, settings, mix);
    written atomically. Returns the manifest."""
    manifest = dict(header)
    for split in ("train", "val"):
        shards = []
        records: list[Record] = []
        for p in shard_paths(folder, split):
            recs = _decode(p)
            records.extend(recs)
            shards.append({"file": p.name, "records": len(recs), "answer_tokens": sum(len(r.response) for r in recs),
                           "bytes": p.stat().st_size, "sha256": file_sha256(p)})
        manifest[split] = {"shards": shards, **summarize(records)}
    fd, tmp = tempfile.mkstemp(prefix=".manifest.", dir=folder)
    with os.fdopen(fd, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, folder / "manifest.json")
    return manifest


def git_commit(folder: Path, message: str, attempts: int = 5) -> None:
    """Commit `folder` (new shards and their manifest, or a training state) and nothing else. A
    busy index (another git command) is retried; a commit that still fails is reported, not
    fatal: the files stay on disk and the next commit takes them along. Nothing new: nothing to do."""
    status = subprocess.run(["git", "status", "--porcelain", "--", str(folder)], capture_output=True, text=True)
    if status.returncode == 0 and not status.stdout.strip():
        return
    for i in range(attempts):
        add = subprocess.run(["git", "add", "--", str(folder)], capture_output=True, text=True)
        done = add.returncode == 0 and subprocess.run(
            ["git", "commit", "-q", "-m", message, "--", str(folder)], capture_output=True, text=True).returncode == 0
        if done:
            return
        time.sleep(2.0 * (i + 1))
    print(f"could not commit {folder} ({message}); it stays on disk", file=sys.stderr)

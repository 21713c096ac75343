"""Draft vocabulary from token frequencies (speculators `build_vocab_mappings_from_distribution`).

Count the loss-masked tokens of the training set, keep the V_d most frequent, sort the ids
ascending (pad with the lowest unused ids when fewer were seen), then d2t[i] = id_i - i and
t2d[id] = True. With V_d = V (or None) the map is the identity (d2t = 0).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def token_counts(pairs: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> np.ndarray:
    counts = np.zeros((vocab_size,), np.int64)
    for tokens, mask in pairs:
        t = np.asarray(tokens)[np.asarray(mask, bool)]
        counts += np.bincount(t, minlength=vocab_size)[:vocab_size]
    return counts


def draft_ids_from_counts(counts: np.ndarray, draft_size: int | None, always: Iterable[int] = ()) -> np.ndarray:
    """Sorted target ids of the draft vocabulary (the `always` ids are forced in)."""
    v = counts.shape[0]
    if draft_size is None or draft_size >= v:
        return np.arange(v, dtype=np.int64)
    c = counts.astype(np.float64).copy()
    for a in always:
        c[a] = np.inf
    # stable: by count descending, then id ascending
    order = np.lexsort((np.arange(v), -c))
    seen = order[: draft_size]
    return np.sort(seen).astype(np.int64)


def vocab_maps(draft_ids: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    d2t = (draft_ids - np.arange(draft_ids.shape[0])).astype(np.int64)
    t2d = np.zeros((vocab_size,), bool)
    t2d[draft_ids] = True
    return d2t, t2d

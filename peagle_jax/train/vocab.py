"""Draft vocabulary from token frequencies (speculators `build_vocab_mappings_from_distribution`).

Count the loss-masked tokens of the training set, keep the V_d most frequent, sort the ids
ascending (pad with the lowest unused ids when fewer were seen), then d2t[i] = id_i - i and
t2d[id] = True. With V_d = V (or None) the map is the identity (d2t = 0).
"""

from __future__ import annotations

from collections.abc import Iterable

import jax.numpy as jnp
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


def with_draft_vocabulary(drafter, target, draft_ids: np.ndarray):
    """The same head over another draft vocabulary (sorted target ids `draft_ids`).

    A head's lm_head is the target's lm_head restricted to the draft ids, and training keeps it
    frozen, so a new vocabulary needs no new weights: every trained tensor is kept, the lm_head
    becomes the target's rows for `draft_ids` and d2t maps them. Use it when the vocabulary a
    head was trained with (counted on one domain) misses tokens other domains use often: a token
    outside it can never be drafted.
    """
    from flax import nnx

    from peagle_jax.drafters.eagle3 import create_drafter

    ids = np.asarray(draft_ids, np.int64)
    v = target.config.vocab_size
    if ids.ndim != 1 or ids.size == 0 or ids[0] < 0 or ids[-1] >= v or np.any(np.diff(ids) <= 0):
        raise ValueError(f"draft_ids must be sorted, distinct target ids in [0, {v}); got {ids.size} ids")
    if drafter.config.vocab_size != v:
        raise ValueError(f"the head was made for a {drafter.config.vocab_size}-token vocabulary, the target has {v}")
    config = drafter.config.replace(draft_vocab_size=int(ids.size))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: create_drafter(config)))
    params = nnx.to_pure_dict(nnx.state(drafter))
    params["lm_head"] = jnp.asarray(target.lm_head_weight()[:, ids], drafter.lm_head[...].dtype)
    params["d2t"] = jnp.asarray(vocab_maps(ids, v)[0], jnp.int32)
    return nnx.merge(graphdef, params)

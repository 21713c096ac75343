"""COD ("conditional drop") sampling for P-EAGLE training, with static shapes.

Reference: speculators `peagle/data.py` (see peagle-reference.md §2.2). For one packed row of
n shifted elements with loss mask l and document ids doc:

* depth 0 keeps all n elements (context); its anchor is its own index;
* seeds = indices with l = 1 (at most `max_anchors`, drawn uniformly, sorted);
* for d = 1..K-1: size_d = floor((|seeds| - d) * max(r^d, r_min)); stop when <= 0; draw size_d
  of the pool (or keep the whole pool when it is smaller); anchor = s - d; next pool =
  {s + 1} restricted to loss positions of the same document.

Deviations (documented): the depth-1 pool drops seeds whose anchor s - 1 would be -1 or in
another document (verl does the same for index 0), so an anchor is never -1 and a chain never
crosses a document boundary. The sizes still use |seeds|, as speculators does.

Static shapes: depth d owns S_d = floor((A - d) * max(r^d, r_min)) slots (A = max_anchors, also
capped by n), padded with `valid = False`. Slots are grouped by depth, so `depth` is static.
`chain_idx[m, j]` is the slot of the same chain at depth j+1 when j+1 <= depth[m], else -1: the
element's own chain keys (itself included) for the training attention.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np


def depth_sizes(num_seeds: int, num_depths: int, ratio: float, ratio_min: float) -> list[int]:
    """size_d for d = 1..K-1 (the speculators formula; zeros after the first non-positive)."""
    out = []
    stop = False
    for d in range(1, num_depths):
        s = int(math.floor((num_seeds - d) * max(ratio**d, ratio_min)))
        if s <= 0 or stop:
            stop = True
            s = 0
        out.append(s)
    return out


def static_slots(seq_len: int, num_depths: int, ratio: float, ratio_min: float, max_anchors: int) -> list[int]:
    """Slots per depth 1..K-1 for the padded layout (the sizes at the maximum seed count)."""
    return depth_sizes(min(max_anchors, seq_len), num_depths, ratio, ratio_min)


class CodLayout(NamedTuple):
    anchor: np.ndarray  # [M] int32 (0 where invalid)
    depth: np.ndarray  # [M] int32, static per slot
    valid: np.ndarray  # [M] bool
    chain_idx: np.ndarray  # [M, K-1] int32, -1 = none


def cod_sample(
    loss_mask: np.ndarray,
    doc: np.ndarray,
    *,
    num_depths: int,
    ratio: float,
    ratio_min: float,
    max_anchors: int,
    rng: np.random.Generator,
) -> CodLayout:
    """COD layout for one row. loss_mask/doc: [n] (doc -1 = padding)."""
    n = loss_mask.shape[0]
    k = num_depths
    slots = static_slots(n, k, ratio, ratio_min, max_anchors)
    m = sum(slots)
    anchor = np.zeros((m,), np.int32)
    depth = (np.concatenate([np.full((s,), d + 1, np.int32) for d, s in enumerate(slots)]) if m
             else np.zeros((0,), np.int32))
    valid = np.zeros((m,), bool)
    chain_idx = np.full((m, max(k - 1, 0)), -1, np.int32)
    lm = np.asarray(loss_mask, bool) & (np.asarray(doc) >= 0)
    seeds = np.flatnonzero(lm)
    if seeds.size > max_anchors:
        seeds = np.sort(rng.choice(seeds, max_anchors, replace=False))
    sizes = depth_sizes(seeds.size, k, ratio, ratio_min)
    pool = seeds[(seeds >= 1)]
    pool = pool[doc[pool - 1] == doc[pool]]
    offsets = np.cumsum([0] + slots)
    anchors_by_depth: list[np.ndarray] = []
    for d in range(1, k):
        size = sizes[d - 1]
        if size <= 0 or pool.size == 0:
            break
        chosen = pool if pool.size <= size else np.sort(rng.choice(pool, size, replace=False))
        anc = (chosen - d).astype(np.int32)
        base = offsets[d - 1]
        cnt = anc.size  # <= slots[d-1] because |pool| <= size_{d-1} and size_d <= S_d
        anchor[base : base + cnt] = anc
        valid[base : base + cnt] = True
        anchors_by_depth.append(anc)
        # chain keys: the same anchor at depths 1..d (prefix property makes every lookup hit)
        for dd in range(1, d + 1):
            prev = anchors_by_depth[dd - 1]
            pos = np.searchsorted(prev, anc)
            assert np.all(prev[pos] == anc), "COD chains must be prefixes"
            chain_idx[base : base + cnt, dd - 1] = offsets[dd - 1] + pos
        nxt = chosen + 1
        keep = nxt < n
        nxt, src_anchor = nxt[keep], anc[keep]
        ok = lm[nxt] & (doc[nxt] == doc[src_anchor])
        pool = nxt[ok]
    return CodLayout(anchor, depth, valid, chain_idx)


def cod_batch(loss_mask, doc, *, num_depths, ratio, ratio_min, max_anchors, rng) -> CodLayout:
    """Stack `cod_sample` over the rows of [B, n] arrays."""
    rows = [
        cod_sample(loss_mask[b], doc[b], num_depths=num_depths, ratio=ratio, ratio_min=ratio_min,
                   max_anchors=max_anchors, rng=rng)
        for b in range(loss_mask.shape[0])
    ]
    return CodLayout(*(np.stack([getattr(r, f) for r in rows]) for f in CodLayout._fields))

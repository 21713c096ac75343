"""COD sampling: counts per depth, prefix chains, no anchor -1, no cross-document element."""

from __future__ import annotations

import math

import numpy as np
import pytest

from peagle_jax.train.cod import cod_sample, depth_sizes, static_slots


def _row(n, docs, rng, p_loss=0.8):
    doc = np.full((n,), -1, np.int32)
    cuts = np.sort(rng.choice(np.arange(1, n - 4), docs - 1, replace=False)) if docs > 1 else np.array([], int)
    used = n - 3  # trailing padding
    bounds = [0, *cuts.tolist(), used]
    for d in range(docs):
        doc[bounds[d] : bounds[d + 1]] = d
    lm = (rng.random(n) < p_loss) & (doc >= 0)
    return lm.astype(np.float32), doc


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k,anchors", [(4, 1000), (8, 1000), (6, 20)])
def test_cod_invariants(seed, k, anchors):
    rng = np.random.default_rng(seed)
    n = 96
    lm, doc = _row(n, 1 + seed % 4, rng)
    lay = cod_sample(lm, doc, num_depths=k, ratio=0.7, ratio_min=0.2, max_anchors=anchors, rng=rng)
    seeds = min(int(lm.sum()), anchors)
    sizes = depth_sizes(seeds, k, 0.7, 0.2)
    assert sizes == [max(0, math.floor((seeds - d) * max(0.7**d, 0.2))) for d in range(1, k)] or 0 in sizes
    # static shapes
    assert lay.anchor.shape == (sum(static_slots(n, k, 0.7, 0.2, anchors)),)
    chains = {}
    for d in range(1, k):
        sel = lay.valid & (lay.depth == d)
        cnt = int(sel.sum())
        assert cnt <= sizes[d - 1]  # count per depth follows the formula (or the pool ran out)
        if d == 1:
            # every eligible seed pool is large enough at depth 1 here, so the count is exact
            eligible = sum(1 for s in np.flatnonzero(lm) if s >= 1 and doc[s - 1] == doc[s])
            assert cnt == min(sizes[0], eligible) or seeds < int(lm.sum())
        a = lay.anchor[sel]
        assert (a >= 0).all(), "never an anchor -1"
        assert (np.diff(a) > 0).all()
        sup = a + d
        assert (sup < n).all()
        assert (lm[sup] > 0).all(), "supervised position is a loss position"
        assert (doc[a] == doc[sup]).all() and (doc[a] >= 0).all(), "no cross-document element"
        for x in a:
            chains.setdefault(int(x), []).append(d)
    for ds in chains.values():
        assert ds == list(range(1, len(ds) + 1)), "chains are prefixes"
    # chain_idx points at the same anchor at depths 1..d, -1 beyond
    for m in np.flatnonzero(lay.valid):
        d = lay.depth[m]
        for j in range(k - 1):
            if j + 1 <= d:
                t = lay.chain_idx[m, j]
                assert lay.valid[t] and lay.anchor[t] == lay.anchor[m] and lay.depth[t] == j + 1
            else:
                assert lay.chain_idx[m, j] == -1
    assert (lay.chain_idx[~lay.valid] == -1).all()


def test_cod_counts_exact_when_all_positions_are_loss():
    n, k = 200, 5
    lm = np.ones(n, np.float32)
    doc = np.zeros(n, np.int32)
    lay = cod_sample(lm, doc, num_depths=k, ratio=0.7, ratio_min=0.2, max_anchors=10**6,
                     rng=np.random.default_rng(0))
    got = [int((lay.valid & (lay.depth == d)).sum()) for d in range(1, k)]
    assert got == [math.floor((n - d) * max(0.7**d, 0.2)) for d in range(1, k)]


def test_cod_deterministic_given_rng():
    rng = np.random.default_rng(3)
    lm, doc = _row(80, 3, rng)
    a = cod_sample(lm, doc, num_depths=5, ratio=0.7, ratio_min=0.2, max_anchors=30, rng=np.random.default_rng(9))
    b = cod_sample(lm, doc, num_depths=5, ratio=0.7, ratio_min=0.2, max_anchors=30, rng=np.random.default_rng(9))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)

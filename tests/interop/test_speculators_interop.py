"""Interop (#19): the speculators package's own model classes compute our heads' logits.

The slow test needs the speculators peer venv (`bash benchmarks/peers/speculators/setup.sh`, at
$SPECULATORS_PEER_DIR or <repo>/../runs/peers/speculators) and is skipped, with the reason,
where it is absent (as in CI). `benchmarks/peer_speculators.py` exports each shipped head in the
speculators layout, runs the same rows (real target features of a chat prompt; for P-EAGLE the
last 3 rows are placeholders: mask token and learned mask_hidden) through our drafter and
through `speculators.models.eagle3` / `.peagle`, both in float32. A misread tensor or config
field (a transposed weight, the norm order, the mask embedding, the rotary base) moves logits
by whole units; float32 rounding between torch and XLA stays below LOGIT_TOL.
"""

from __future__ import annotations

import pytest

from benchmarks import peer_speculators

# Measured (2026-12-01, speculators 0.9.0): max |ours - theirs| 2.5e-5 on logits up to 23.6.
LOGIT_TOL = 1e-3


def test_missing_peer_env_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULATORS_PEER_DIR", str(tmp_path / "nowhere"))
    reason = peer_speculators.missing_reason()
    assert reason and "setup.sh" in reason and "nowhere" in reason


@pytest.mark.slow
def test_speculators_model_classes_give_our_logits(tmp_path):
    reason = peer_speculators.missing_reason()
    if reason:
        pytest.skip(reason)
    summary = peer_speculators.main(["--out", str(tmp_path / "out")])
    by_method = {r["method"]: r for r in summary["results"]}
    assert set(by_method) == {"eagle3", "peagle"}
    assert by_method["peagle"]["mask_rows"] == 3 and by_method["eagle3"]["mask_rows"] == 0
    for r in summary["results"]:
        assert r["max_abs_diff"] < LOGIT_TOL, r
        assert r["argmax_agreement"] == 1.0, r

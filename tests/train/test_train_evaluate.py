"""peagle_jax.train.evaluate: greedy acceptance of a run's head on held-out prompts.

The run is the hand-made tiny one of tiny_train_run.py (random target, so the prompts are the
random 4-token ones); speculative_generate is wrapped to see what evaluate asks of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx
from tiny_train_run import TINY, tiny_config, write_features

import peagle_jax.generate as generate
from peagle_jax.checkpoints import drafter_io
from peagle_jax.drafters.reference import ReferenceDrafter
from peagle_jax.train import evaluate
from peagle_jax.train.train import Trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run checkpointed at step 0 and again at step 2 with different weights."""
    tmp = tmp_path_factory.mktemp("evaluate")
    cfg = tiny_config(tmp)
    write_features(cfg.features_dir / "train", [20, 12, 9, 30], source="selfdistill", seed=0)
    write_features(cfg.features_dir / "val", [15, 11], source="selfdistill", seed=1)
    tr = Trainer(cfg, log=lambda *_: None)
    tr.save()
    keys = iter(jax.random.split(jax.random.key(7), 1000))
    tr.trainable = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape, x.dtype), tr.trainable)
    tr.step = 2
    tr.save()
    return cfg, tr


@pytest.fixture
def calls(monkeypatch):
    """Record every speculative_generate call evaluate makes (drafter, prompts, options, result).

    `calls.results`: canned results to return instead of generating (no compile), one per call;
    `calls.oracle = wrong_every`: generate for real, but draft with a ReferenceDrafter replaying the
    target's own greedy output, wrong at the output positions p with (p * 7 + 3) % wrong_every == 0.
    """
    real = generate.speculative_generate

    class Calls(list):
        results = None
        oracle = None

    seen = Calls()

    def spy(target, drafter, prompts, **kw):
        if seen.results is not None:
            res = seen.results[len(seen)]
        else:
            used = drafter
            if seen.oracle is not None:
                k = kw["num_draft_tokens"]
                ref = real(target, None, prompts, method="none", max_new_tokens=kw["max_new_tokens"] + k)
                used = ReferenceDrafter(np.array(ref.tokens), TINY["vocab_size"], wrong_every=seen.oracle)
            res = real(target, used, prompts, **kw)
        seen.append((drafter, [list(p) for p in prompts], kw, res))
        return res

    monkeypatch.setattr(generate, "speculative_generate", spy)
    return seen


def _head(parallel: bool) -> SimpleNamespace:
    """A stand-in head that `api.method_for` reads as P-EAGLE (parallel) or EAGLE-3."""
    return SimpleNamespace(uses_features=True, config=SimpleNamespace(parallel_drafting=parallel))


def _evaluate(capsys, *argv) -> dict:
    evaluate.main(list(argv))
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_evaluates_the_latest_checkpoint_on_seeded_prompts_in_batches(run, calls, capsys):
    cfg, tr = run
    # canned per-batch results: batch sizes 2, 2, 1 -> 5 + 6 + 4 = 15 rounds, accepted [9, 5, 2]
    calls.results = [SimpleNamespace(total_rounds=5, accepted_per_position=np.array([4, 2, 1])),
                     SimpleNamespace(total_rounds=6, accepted_per_position=np.array([3, 2, 1])),
                     SimpleNamespace(total_rounds=4, accepted_per_position=np.array([2, 1, 0]))]
    out = _evaluate(capsys, "--run_dir", cfg.run_dir, "--prompts", "5", "--batch", "2", "--max_new_tokens", "8")

    # the prompts: 5 random 4-token ones (seed 123; the random target has no tokenizer), 2 per call
    rng = np.random.default_rng(123)
    want = [rng.integers(1, TINY["vocab_size"] - 1, 4).tolist() for _ in range(5)]
    assert [p for _, p, _, _ in calls] == [want[0:2], want[2:4], want[4:5]]
    # K defaults to the run's num_depths; the method is the run's; greedy, no EOS (random target)
    assert all(kw == {"method": "peagle", "num_draft_tokens": 3, "max_new_tokens": 8, "eos_token_ids": []}
               for _, _, kw, _ in calls)
    # the drafter is the step-2 checkpoint's (the perturbed weights), not the step-0 one
    want_state = nnx.state(tr.drafter(), nnx.Param)
    for drafter, _, _, _ in calls:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6),
                     nnx.state(drafter, nnx.Param), want_state)
    assert out == {"step": 2, "head": None, "method": "peagle", "num_draft_tokens": 3, "prompts": 5,
                   "mean_acceptance_length": pytest.approx((15 + 16) / 15),
                   "acceptance_rate_per_position": [0.6, 0.3333, 0.1333]}

    calls.clear()
    calls.results = [SimpleNamespace(total_rounds=4, accepted_per_position=np.array([2, 1]))]
    out = _evaluate(capsys, "--run_dir", cfg.run_dir, "--prompts", "1", "--num_draft_tokens", "2")
    assert calls[0][2]["num_draft_tokens"] == 2 and calls[0][2]["max_new_tokens"] == 128  # the default
    assert out["num_draft_tokens"] == 2 and out["acceptance_rate_per_position"] == [0.5, 0.25]
    assert out["mean_acceptance_length"] == pytest.approx(7 / 4)


def test_acceptance_of_an_oracle_head_is_the_hand_computed_one(run, calls, capsys, monkeypatch):
    cfg, _ = run
    sentinel = _head(parallel=True)  # a P-EAGLE head: the run's method
    monkeypatch.setattr(drafter_io, "load_drafter", lambda path, target: sentinel if path == "HEAD" else None)
    calls.oracle = 4  # wrong exactly at output positions p = 3, 7, 11, ...
    out = _evaluate(capsys, "--run_dir", cfg.run_dir, "--head", "HEAD", "--prompts", "2", "--batch", "1",
                    "--max_new_tokens", "12")
    assert [d for d, *_ in calls] == [sentinel, sentinel]  # --head replaces the checkpoint's drafter
    # Each prompt, K=3, 12 new tokens (the first from the prefill, out_len 1): round 1 drafts
    # p=1,2,3 (p=3 wrong: 2 accepted, out_len 4); round 2 drafts p=4,5,6 (all right, out_len 8);
    # round 3 drafts p=8,9,10 (all right, out_len 12). Per prompt: 3 rounds, accepted per
    # position [3, 3, 2]; two prompts: 6 rounds, [6, 6, 4].
    assert [r.rounds.tolist() for *_, r in calls] == [[3], [3]]
    assert out["acceptance_rate_per_position"] == [1.0, 1.0, 0.6667]
    assert out["mean_acceptance_length"] == pytest.approx((6 + 16) / 6)
    assert out["step"] is None and out["head"] == "HEAD"  # the head's, not the run's latest checkpoint


def test_a_head_is_measured_with_its_own_method_on_the_runs_prompts(run, calls, capsys, monkeypatch):
    cfg, _ = run  # a P-EAGLE run; the head drafts sequentially, so it is measured as EAGLE-3
    monkeypatch.setattr(drafter_io, "load_drafter", lambda path, target: _head(parallel=False))
    calls.results = [SimpleNamespace(total_rounds=2, accepted_per_position=np.array([1, 0, 0]))]
    out = _evaluate(capsys, "--run_dir", cfg.run_dir, "--head", "EAGLE3", "--prompts", "1")
    assert calls[0][2]["method"] == "eagle3" and out["method"] == "eagle3"


def test_cli_module_path():
    p = subprocess.run([sys.executable, "-m", "peagle_jax.train.evaluate", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "usage: python -m peagle_jax.train.evaluate" in p.stdout
    p = subprocess.run([sys.executable, "-m", "peagle_jax.train.evaluate"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--run_dir" in p.stderr and "--config" in p.stderr
    p = subprocess.run([sys.executable, "-m", "peagle_jax.train.evaluate", "--config", "no/such.yaml"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no/such.yaml does not exist" in p.stderr and "Traceback" not in p.stderr

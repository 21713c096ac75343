"""Training loop: config overrides, exact resume after a crash, data-parallel == 1 device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from peagle_jax.train.config import TrainConfig, load_config, parse_overrides
from peagle_jax.train.train import Trainer

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256)


def _cfg(tmp, run, **over):
    base = {
        "run_dir": str(tmp / run), "batch_size": 4, "progress": False, "seed": 3,
        "model": {"random_target": TINY},
        "data": {"source": "random", "seq_len": 48, "features_dir": str(tmp / "feat"), "random_docs": 24,
                 "random_new_tokens": 30, "noise_std": 0.05},
        "objective": {"method": "peagle", "num_depths": 3, "max_anchors": 24},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "total_steps": 20}, "checkpoint_every": 2,
    }
    for k, v in over.items():
        node = base
        parts = k.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return load_config(None, base)


def test_config_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("run_dir: /x\noptim:\n  lr: 0.1\nobjective:\n  method: eagle3\n")
    path, over = parse_overrides(["--config", str(y), "optim.lr=2e-4", "--objective.num_depths", "6",
                                  "--data.noise_std=0.05", "drafter.draft_vocab_size=null"])
    cfg = load_config(path, over)
    assert cfg.optim.lr == 2e-4 and cfg.objective.num_depths == 6 and cfg.objective.method == "eagle3"
    assert cfg.data.noise_std == 0.05 and cfg.drafter.draft_vocab_size is None and cfg.run_dir == "/x"
    with pytest.raises(ValidationError, match="frozen_instance"):
        cfg.optim.lr = 1.0  # frozen
    with pytest.raises(ValidationError, match="extra_forbidden"):
        load_config(None, {"optim": {"nope": 1}})
    for f in sorted((ROOT / "configs" / "train").glob("*.yaml")):
        TrainConfig.model_validate(__import__("yaml").safe_load(f.read_text()))


def test_cli_bad_input_is_one_line_not_a_traceback(tmp_path):
    """A missing config, an unknown key, a bad value or data that is not there: the entry
    points exit with a message naming it."""
    from peagle_jax.train import features, train

    y = tmp_path / "c.yaml"
    y.write_text(f"run_dir: {tmp_path / 'run'}\n")
    cases = [(["--config", str(tmp_path / "nope.yaml")], "config: .*nope.yaml"),
             (["--config", str(y), "optim.nope=1"], "config: .*optim.nope"),
             (["--config", str(y), "optim.lr=fast"], "config: .*optim.lr"),
             (["--config", str(y), "stray"], "config: cannot parse argument 'stray'")]
    for argv, match in cases:
        for entry in (train.main, features.main):
            with pytest.raises(SystemExit, match=match):
                entry(argv)
    no_data = ["--config", str(y), "data.source=generated", f"data.generated_dir={tmp_path / 'empty'}",
               "data.features=online", f"model.random_target={json.dumps(TINY)}"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="train: .*empty holds no train shards; write them first"):
        train.main(no_data)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["peagle"])
def test_resume_after_crash_gives_same_losses(tmp_path, method):
    over = {"objective.method": method, "max_steps": 5}
    full = Trainer(_cfg(tmp_path, "full", **over)).run()

    crashing = Trainer(_cfg(tmp_path, "crash", **over))
    real = crashing.train_one
    calls = {"n": 0}

    def boom():
        calls["n"] += 1
        if calls["n"] == 4:  # dies during step 4; the latest checkpoint is step 2
            raise KeyboardInterrupt
        return real()

    crashing.train_one = boom
    with pytest.raises(KeyboardInterrupt):
        crashing.run()
    # a save killed half-way leaves only an uncommitted temporary directory: it must be ignored
    junk = tmp_path / "crash" / "checkpoints" / "4.orbax-checkpoint-tmp-1234567890"
    junk.mkdir()
    (junk / "garbage").write_bytes(b"\x00" * 10)
    resumed = Trainer(_cfg(tmp_path, "crash", **over))
    assert resumed.step == 2
    rest = resumed.run()
    assert [r["step"] for r in rest] == [3, 4, 5]
    np.testing.assert_allclose([r["loss"] for r in rest], [r["loss"] for r in full[2:]], rtol=1e-5)
    lines = [json.loads(line) for line in (tmp_path / "crash" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5]


DP_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    assert jax.device_count() == 2, jax.devices()
    sys.path[:0] = [{tests!r}, {tests_root!r}]  # this test's folder, and tests/ for its conftest
    from test_train_loop import _cfg
    from pathlib import Path
    from peagle_jax.train.train import Trainer
    tmp = Path({tmp!r})
    out = {{}}
    for n in (1, 2):
        out[n] = [r["loss"] for r in Trainer(_cfg(tmp, f"dp{{n}}", mesh_data=n, max_steps=3, matmul="xla")).run()]
    print("RESULT", json.dumps(out))
""")


@pytest.mark.slow
def test_data_parallel_two_fake_devices_matches_one(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    script = DP_SCRIPT.format(tests=str(Path(__file__).parent), tests_root=str(ROOT / "tests"), tmp=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.split("RESULT", 1)[1])
    np.testing.assert_allclose(res["2"], res["1"], rtol=2e-5)


@pytest.mark.slow
def test_fine_tuning_starts_from_the_saved_head_and_keeps_its_vocabulary(tmp_path):
    from peagle_jax.train.export import export

    first = Trainer(_cfg(tmp_path, "first", max_steps=3, **{"drafter.draft_vocab_size": 32}))
    first.run()
    head = export(first.cfg.run_dir, tmp_path / "head", layout="aws", dtype="float32")[0]

    tuned = Trainer(_cfg(tmp_path, "tuned", max_steps=2, **{"drafter.init_from": str(head)}))
    np.testing.assert_array_equal(tuned.draft_ids, first.draft_ids)
    np.testing.assert_array_equal(np.load(tmp_path / "tuned" / "draft_ids.npy"), first.draft_ids)
    assert tuned.trainable.keys() == first.trainable.keys()
    for k, v in first.trainable.items():  # the saved weights, not a fresh initialisation
        np.testing.assert_array_equal(np.asarray(tuned.trainable[k]), np.asarray(v), err_msg=k)
    recs = tuned.run()
    assert [r["step"] for r in recs] == [1, 2] and all(np.isfinite(r["loss"]) for r in recs)

    with pytest.raises(ValueError, match=r"drafter.num_layers: config 2, head 1"):
        Trainer(_cfg(tmp_path, "clash", **{"drafter.init_from": str(head), "drafter.num_layers": 2}))
    with pytest.raises(ValueError, match=r"objective.method: config eagle3, head peagle"):
        Trainer(_cfg(tmp_path, "clash2", **{"drafter.init_from": str(head), "objective.method": "eagle3"}))


@pytest.mark.slow
def test_fine_tuning_can_give_the_head_the_data_vocabulary(tmp_path):
    """init_vocab=data: the run's most frequent tokens become the draft vocabulary, every trained
    weight is the saved head's, and the lm_head is the target's rows for the new ids."""
    import jax.numpy as jnp

    from peagle_jax.checkpoints.drafter_io import load_drafter
    from peagle_jax.train.export import export
    from peagle_jax.train.vocab import with_draft_vocabulary

    first = Trainer(_cfg(tmp_path, "first", max_steps=2, **{"drafter.draft_vocab_size": 32}))
    first.run()
    head = export(first.cfg.run_dir, tmp_path / "head", layout="aws", dtype="float32")[0]
    tuned = Trainer(_cfg(tmp_path, "tuned", max_steps=1, **{
        "drafter.init_from": str(head), "drafter.init_vocab": "data", "drafter.draft_vocab_size": 20,
        "data.random_docs": 12, "data.features_dir": str(tmp_path / "feat2"), "seed": 5}))
    ids = tuned.draft_ids
    assert ids.shape == (20,) and not np.array_equal(ids, first.draft_ids[:20])
    for k, v in first.trainable.items():  # the saved weights, not a fresh initialisation
        np.testing.assert_array_equal(np.asarray(tuned.trainable[k]), np.asarray(v), err_msg=k)
    target_rows = np.asarray(tuned.target.lm_head_weight())[:, ids]
    np.testing.assert_array_equal(np.asarray(tuned.frozen["lm_head"]), target_rows)
    np.testing.assert_array_equal(np.arange(20) + np.asarray(tuned.frozen["d2t"]), ids)
    assert all(np.isfinite(r["loss"]) for r in tuned.run())

    # A token in both vocabularies gets the same draft logit from the old and the new head.
    old = load_drafter(head, target=tuned.target)
    new = with_draft_vocabulary(old, tuned.target, ids)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32)), jnp.float32)
    both = np.intersect1d(first.draft_ids, ids)
    old_col = np.searchsorted(first.draft_ids, both)
    new_col = np.searchsorted(ids, both)
    np.testing.assert_allclose(np.asarray(new.logits_from_prenorm(x))[:, new_col],
                               np.asarray(old.logits_from_prenorm(x))[:, old_col], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="sorted, distinct"):
        with_draft_vocabulary(old, tuned.target, ids[::-1])
    with pytest.raises(ValidationError, match="init_vocab=data"):
        _cfg(tmp_path, "novocab", **{"drafter.init_vocab": "data"})


def test_step_on_the_cpu_kernel_follows_xla(tmp_path):
    """matmul=cpu_kernel (the default on AMX) trains the same head as XLA's float32 products, up
    to the bf16 rounding of their operands; where it cannot run, asking for it says why."""
    import kernels_cpu
    from peagle_jax.train.train import step_matmuls_on_cpu_kernel

    assert not step_matmuls_on_cpu_kernel(_cfg(tmp_path, "x", matmul="xla"), 1)
    if not kernels_cpu.available():
        with pytest.raises(ValueError, match="matmul=cpu_kernel cannot run here"):
            step_matmuls_on_cpu_kernel(_cfg(tmp_path, "k", matmul="cpu_kernel"), 1)
        pytest.skip(f"kernels_cpu unavailable: {kernels_cpu.unavailable_reason()}")
    with pytest.raises(ValueError, match="2 devices"):
        step_matmuls_on_cpu_kernel(_cfg(tmp_path, "k", matmul="cpu_kernel"), 2)
    losses = {m: [r["loss"] for r in Trainer(_cfg(tmp_path, m, matmul=m, max_steps=4)).run()]
              for m in ("xla", "cpu_kernel")}
    np.testing.assert_allclose(losses["cpu_kernel"], losses["xla"], rtol=2e-2)
    assert losses["cpu_kernel"][-1] < losses["cpu_kernel"][0]

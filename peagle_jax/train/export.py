"""Export a trained run to drafter checkpoints (AWS and/or speculators layout).

    python -m peagle_jax.train.export --run_dir /work/runs/peagle_smollm2 --out /work/runs/peagle_smollm2/export \
        [--layout both|aws|speculators] [--dtype bfloat16|float32] [--step N]

Size policy (SmolLM2-135M: H=576, V=49152):
* `lm_head` is never shipped: it is frozen during training and equal to the target's lm_head
  restricted to the draft vocabulary, so `load_drafter(path, target=...)` (and vLLM's
  `_maybe_share_lm_head`) rebuild it exactly from the target and `d2t`.
* `embed_tokens` is shipped only when it was trained (`drafter.train_embed` = mask_row / all).
  The default recipe freezes the whole embedding, including the mask token's row, and lets
  the learned `mask_hidden` (through fc) carry the placeholder signal; the head then omits
  the table (the loader shares the target's, which is exactly what training used) and a 1-layer
  SmolLM2 head is about 10 MB in bf16. A trained mask row forces the full [V, H] table into the
  file (57 MB in bf16 for SmolLM2), because neither layout has a slot for one row.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import yaml

from peagle_jax.checkpoints.drafter_io import save_drafter
from peagle_jax.train.config import TrainConfig
from peagle_jax.train.features import load_target_and_tokenizer
from peagle_jax.train.train import build_drafter, export_drafter, make_optimizer, split_params


def load_trained(run_dir: str | Path, step: int | None = None, target=None):
    """(drafter with trained weights, target, config, step) from a run directory."""
    run_dir = Path(run_dir)
    cfg = TrainConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    if target is None:
        target, _, _, _ = load_target_and_tokenizer(cfg)
    draft_ids = np.load(run_dir / "draft_ids.npy")
    drafter = build_drafter(cfg, target, draft_ids)
    graphdef, trainable, frozen = split_params(drafter, cfg.drafter.train_embed, cfg.objective.method)
    tx, _ = make_optimizer(cfg)
    mgr = ocp.CheckpointManager((run_dir / "checkpoints").absolute())
    step = mgr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint under {run_dir / 'checkpoints'}")
    abstract = {"trainable": trainable, "opt_state": tx.init(trainable)}
    out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                    meta=ocp.args.JsonRestore()))
    return export_drafter(graphdef, out["state"]["trainable"], frozen), target, cfg, step


def export(run_dir, out, *, layout="both", dtype="bfloat16", step=None) -> list[Path]:
    drafter, target, cfg, step = load_trained(run_dir, step)
    include_embed = cfg.drafter.train_embed != "none"
    paths = []
    for lay in (["aws", "speculators"] if layout == "both" else [layout]):
        dest = Path(out) / lay
        with warnings.catch_warnings():
            if not include_embed:  # the frozen table equals the target's: sharing it is exact
                warnings.filterwarnings("ignore", message="saving a P-EAGLE head without embed_tokens")
            save_drafter(drafter, dest, layout=lay, target_config=target.config, include_embed_tokens=include_embed,
                         include_lm_head=False, dtype=dtype)
        size = sum(f.stat().st_size for f in dest.iterdir())
        print(json.dumps({"layout": lay, "path": str(dest), "step": step, "bytes": size}))
        paths.append(dest)
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m peagle_jax.train.export")
    p.add_argument("--run_dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layout", default="both", choices=["both", "aws", "speculators"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--step", type=int, default=None)
    a = p.parse_args(argv)
    export(a.run_dir, a.out, layout=a.layout, dtype=a.dtype, step=a.step)


if __name__ == "__main__":
    main()

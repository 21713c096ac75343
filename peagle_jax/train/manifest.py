"""Write `manifest.json` beside an exported head: how it was made and how good it is.

    python -m peagle_jax.train.manifest --run_dir ../runs/peagle_smollm2 --head assets/heads/smollm2-135m-peagle \
        --command "python -m peagle_jax.train.train --config configs/train/peagle_smollm2.yaml ..." [--val_batches 8]
    python -m peagle_jax.train.manifest --config configs/train/peagle_qwen05.yaml --head DIR --command "..." \
        [--extra acceptance.json]

The second form reads the state the run committed (`train.committed`, with the metrics it
carries) instead of a run directory, and so has no held-out accuracy (that needs features):
give held-out acceptance with --extra.

Records the exact command and resolved config, data sources and token counts, steps, wall
time (sum of step times), final training loss, per-depth held-out accuracy (the training
objective on the validation split), and the sha256 and size of every file in the head.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import yaml


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def training_summary(run_dir: Path, text: str | None = None) -> dict:
    """Steps, time, tokens, final loss and accuracy from a run's metrics.jsonl (or its `text`)."""
    source = f"{run_dir}/metrics.jsonl"
    if text is None:
        text = (run_dir / "metrics.jsonl").read_text()
    recs = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not recs:
        raise ValueError(f"{source} has no records: nothing was trained")
    last = recs[-10:]
    acc = np.array([[a if a is not None else np.nan for a in r["acc"]] for r in last], dtype=float)
    return {
        "steps": int(recs[-1]["step"]),
        "wall_time_s": round(float(sum(r.get("step_time", 0.0) for r in recs)), 1),
        "tokens_seen": int(sum(r.get("tokens", 0) for r in recs)),
        "final_loss": round(float(np.mean([r["loss"] for r in last])), 4),
        "final_train_acc_per_depth": [None if np.isnan(a) else round(float(a), 4) for a in np.nanmean(acc, axis=0)],
        "final_lr": recs[-1].get("lr"),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m peagle_jax.train.manifest", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run_dir", help="the run directory (its latest checkpoint, metrics and features)")
    src.add_argument("--config", help="a training config whose committed state (state_dir) made the head: on a "
                                      "machine without the run directory; no held-out accuracy (it needs features)")
    ap.add_argument("--head", required=True, help="the exported head directory (manifest.json goes there)")
    ap.add_argument("--command", required=True, help="the exact training command line")
    ap.add_argument("--val_batches", type=int, default=8)
    ap.add_argument("--extra", default=None, help="JSON file merged into the manifest (e.g. acceptance results)")
    a = ap.parse_args(argv)

    from peagle_jax.train.config import TrainConfig
    from peagle_jax.train.train import Trainer

    head = Path(a.head)
    if a.config is not None:
        from peagle_jax.train.committed import draft_ids_file, read_metrics, read_state_info

        cfg = TrainConfig.model_validate(yaml.safe_load(Path(a.config).read_text()))
        info = read_state_info(cfg.state_dir)
        if info is None:
            raise SystemExit(f"--config {a.config}: no committed state under its state_dir ({cfg.state_dir})")
        run_dir = Path(cfg.run_dir)
        metrics = read_metrics(cfg.state_dir)
        training = (training_summary(run_dir, metrics) if metrics is not None else
                    {"steps": int(info["step"]), "metrics": "not carried by this committed state"})
        draft_size = int(np.load(draft_ids_file(cfg.state_dir)).shape[0])
        held_out, stores = None, {}
    else:
        run_dir = Path(a.run_dir)
        cfg = TrainConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
        trainer = Trainer(cfg, log=lambda *_: None)  # restores the latest checkpoint
        result = trainer.evaluate(a.val_batches)
        held_out = {"val_batches": a.val_batches, "val_loss": round(result["val_loss"], 4),
                    "val_acc_per_depth": [None if x is None else round(x, 4) for x in result["val_acc"]]}
        training = training_summary(run_dir)
        draft_size = int(trainer.draft_ids.shape[0])
        stores = getattr(trainer, "stores", {})
    data = {
        "source": cfg.data.source,
        "features_dir": cfg.data.features_dir,
        "train_documents": len(stores["train"]) if "train" in stores else None,
        "train_tokens": int(sum(stores["train"].lengths())) if "train" in stores else None,
        "val_documents": len(stores["val"]) if "val" in stores else None,
        "val_tokens": int(sum(stores["val"].lengths())) if "val" in stores else None,
    }
    descriptions = {
        "selfdistill": ("HumanEval-style prompts cut from the Python standard library (function signature "
                        "+ docstring, whole files held out for validation), answered by the target itself "
                        "(greedy, chat template): self-distillation"),
        "code": "Python standard library .py files (whole files held out for validation), raw text",
        "generated": ("multi-domain prompts (peagle_jax.train.prompts: Magpie self-written user turns, stdlib "
                      "functions, documentation summaries, rewriting, translation, math, follow-ups) answered by "
                      "the target itself (greedy, chat template), written by peagle_jax.train.generate_data; its "
                      "manifest_{split}.json in data.generated_dir has the mix and token counts"),
    }
    if cfg.data.source in descriptions:
        data["description"] = descriptions[cfg.data.source]
    parts = getattr(stores.get("train"), "stores", None)
    if parts:  # own shards + data.extra_train_features, each with its source and size
        data["train_parts"] = [{"folder": str(st.root), "source": st.meta.get("source"), "documents": len(st),
                                "tokens": int(sum(st.lengths())),
                                "description": descriptions.get(st.meta.get("source"))} for st in parts]
    manifest = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "method": cfg.objective.method,
        "target": str(cfg.model.target),
        "drafter": {"num_layers": cfg.drafter.num_layers, "draft_vocab_size": draft_size,
                    "num_depths": cfg.objective.num_depths, "mask_token_id": cfg.drafter.mask_token_id,
                    "train_embed": cfg.drafter.train_embed},
        "command": a.command,
        "config": cfg.model_dump(),
        "data": data,
        "training": training,
        "held_out": held_out,
        "files": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                  for p in sorted(head.rglob("*")) if p.is_file() and p.name != "manifest.json"},
    }
    if a.extra:
        manifest.update(json.loads(Path(a.extra).read_text()))
    (head / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps({k: manifest[k] for k in ("method", "training", "held_out")}, indent=2))


if __name__ == "__main__":
    main()

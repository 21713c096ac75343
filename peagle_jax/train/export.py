"""Export a trained run to drafter checkpoints (AWS and/or speculators layout).

    python -m peagle_jax.train.export --run_dir ../runs/peagle_smollm2 --out ../runs/peagle_smollm2/export \
        [--layout both|aws|speculators] [--dtype bfloat16|float32] [--step N]
    python -m peagle_jax.train.export --config configs/train/peagle_qwen05.yaml --out DIR [--layout aws]
    python -m peagle_jax.train.export --head OLD_HEAD_DIR --out NEW_DIR [--model default] [--layout aws]
        [--vocab-from DATA_DIR [--draft-vocab-size N]]

The second form exports the weights a run committed to the repository (its config's
`state_dir`, `train.committed`), on a machine without the run directory or its features.
The third form rewrites an existing head (either layout) under this policy, e.g. a head
exported before the lm_head was shipped; its weights are unchanged. With --vocab-from it also
gives the head a new draft vocabulary: the N (default: the head's size) tokens its target
writes most often in DATA_DIR (a `generate_data` folder of shards, response tokens only);
the trained weights are kept and the lm_head becomes the target's rows for the new ids
(`train.vocab.with_draft_vocabulary`).

Size policy (SmolLM2-135M: H=576, V=49152):
* `lm_head` (the draft-vocabulary rows, [Vd, H]) is always shipped, although it is frozen
  during training and our `load_drafter(path, target=...)` could rebuild it from the target and
  `d2t`: vLLM, finding no `lm_head.weight`, substitutes the target's full [V, H] lm_head, whose
  logits index the target vocabulary while `d2t` expects draft ids, and then accepts nothing.
  It costs Vd * H * 2 bytes in bf16 (9.4 MB for SmolLM2 with an 8k draft vocabulary).
* `embed_tokens` is shipped only when it was trained (`drafter.train_embed` = mask_row / all).
  The default recipe freezes the whole embedding, including the mask token's row, and lets
  the learned `mask_hidden` (through fc) carry the placeholder signal; the head then omits
  the table (the loader shares the target's, which is exactly what training used) and a 1-layer
  SmolLM2 head is about 20 MB in bf16. A trained mask row forces the full [V, H] table into the
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

from peagle_jax.checkpoints.drafter_io import save_drafter, tensor_names
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


def load_committed(config: str | Path, target=None):
    """(drafter, target, config, step) from the weights a run committed to the repository
    (its config's `state_dir`, `train.committed`): a head from a fresh machine, with no run
    directory and no features."""
    from peagle_jax.train.committed import draft_ids_file, load_trainable, read_state_info

    cfg = TrainConfig.model_validate(yaml.safe_load(Path(config).read_text()))
    if read_state_info(cfg.state_dir) is None:
        raise FileNotFoundError(f"{config}: no committed state under its state_dir ({cfg.state_dir})")
    if target is None:
        target, _, _, _ = load_target_and_tokenizer(cfg)
    drafter = build_drafter(cfg, target, np.load(draft_ids_file(cfg.state_dir)))
    graphdef, trainable, frozen = split_params(drafter, cfg.drafter.train_embed, cfg.objective.method)
    step, trainable = load_trainable(cfg.state_dir, trainable)
    return export_drafter(graphdef, trainable, frozen), target, cfg, step


def export(run_dir, out, *, layout="both", dtype="bfloat16", step=None, config=None) -> list[Path]:
    """Save a run's head (its latest or `step` checkpoint; with `config` instead of `run_dir`,
    the state committed under that config's state_dir) under `out/<layout>`."""
    if config is not None:
        drafter, target, cfg, step = load_committed(config)
    else:
        drafter, target, cfg, step = load_trained(run_dir, step)
    include_embed = cfg.drafter.train_embed != "none"
    paths = []
    for lay in (["aws", "speculators"] if layout == "both" else [layout]):
        dest = Path(out) / lay
        with warnings.catch_warnings():
            if not include_embed:  # the frozen table equals the target's: sharing it is exact
                warnings.filterwarnings("ignore", message="saving a P-EAGLE head without embed_tokens")
            save_drafter(drafter, dest, layout=lay, target_config=target.config, include_embed_tokens=include_embed,
                         include_lm_head=True, dtype=dtype)
        size = sum(f.stat().st_size for f in dest.iterdir())
        print(json.dumps({"layout": lay, "path": str(dest), "step": step, "bytes": size}))
        paths.append(dest)
    return paths


def draft_ids_from_answers(data_dir: str | Path, vocab_size: int, draft_size: int, always=()) -> np.ndarray:
    """The `draft_size` response tokens written most often in a `generate_data` directory."""
    from peagle_jax.train.features import generated_docs
    from peagle_jax.train.vocab import draft_ids_from_counts, token_counts

    docs = generated_docs(str(data_dir), "train")
    counts = token_counts(((d.tokens, d.loss_mask) for d in docs), vocab_size)
    if not counts.any():
        raise ValueError(f"--vocab-from {data_dir}: its train shards hold no response tokens")
    return draft_ids_from_counts(counts, draft_size, always=always)


def reexport(head, out, *, model=None, layout="aws", dtype="bfloat16", vocab_from=None,
             draft_vocab_size=None) -> list[Path]:
    """Rewrite the head directory `head` (AWS or speculators layout) into `out` with the lm_head
    included; tensors the head left out (lm_head, a frozen embedding) come from the target.
    `vocab_from` (a `generate_data` directory) also replaces its draft vocabulary."""
    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.default_model import resolve_model_path
    from peagle_jax.checkpoints.drafter_io import load_drafter
    from peagle_jax.checkpoints.tokenizer import eos_token_ids, load_tokenizer
    from peagle_jax.train.vocab import with_draft_vocabulary

    head = Path(head)
    path = resolve_model_path(model)
    target = load_target(path, dtype="float32")
    drafter = load_drafter(head, target=target)
    if vocab_from is not None:  # EOS always in, as training's vocabularies have it
        size = draft_vocab_size or drafter.config.draft_vocab_size
        eos = eos_token_ids(load_tokenizer(path), path)
        ids = draft_ids_from_answers(vocab_from, target.config.vocab_size, size, always=eos)
        drafter = with_draft_vocabulary(drafter, target, ids)
    include_embed = "embed_tokens.weight" in tensor_names(head)
    paths = []
    for lay in (["aws", "speculators"] if layout == "both" else [layout]):
        dest = Path(out) / lay if layout == "both" else Path(out)
        with warnings.catch_warnings():
            if not include_embed:  # the source head shared the target's table already
                warnings.filterwarnings("ignore", message="saving a P-EAGLE head without embed_tokens")
            save_drafter(drafter, dest, layout=lay, target_config=target.config, include_embed_tokens=include_embed,
                         include_lm_head=True, dtype=dtype)
        print(json.dumps({"layout": lay, "path": str(dest), "bytes": sum(f.stat().st_size for f in dest.iterdir())}))
        paths.append(dest)
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m peagle_jax.train.export")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run_dir", help="a training run directory (its latest or --step checkpoint)")
    src.add_argument("--head", help="an exported head directory to rewrite under the current policy")
    src.add_argument("--config", help="a training config: export the state its run committed (its state_dir)")
    p.add_argument("--out", required=True)
    p.add_argument("--layout", default=None, choices=["both", "aws", "speculators"],
                   help="default: both for --run_dir and --config, aws for --head")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--model", default=None, help="--head only: the target (default: the built-in model)")
    p.add_argument("--vocab-from", default=None,
                   help="--head only: a generate_data directory; the head gets the draft vocabulary of its answers")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="with --vocab-from: tokens in the new draft vocabulary (default: the head's)")
    a = p.parse_args(argv)
    if a.head is None and (a.vocab_from is not None or a.draft_vocab_size is not None):
        p.error("--vocab-from and --draft-vocab-size rewrite an exported head: give --head")
    if a.draft_vocab_size is not None and a.vocab_from is None:
        p.error("--draft-vocab-size needs --vocab-from (the counts that choose the tokens)")
    if a.draft_vocab_size is not None and a.draft_vocab_size < 1:
        p.error("--draft-vocab-size must be >= 1")
    if a.head is not None:
        if Path(a.out).resolve() == Path(a.head).resolve():
            p.error("--out must differ from --head (write elsewhere, then replace)")
        reexport(a.head, a.out, model=a.model, layout=a.layout or "aws", dtype=a.dtype, vocab_from=a.vocab_from,
                 draft_vocab_size=a.draft_vocab_size)
    else:
        if a.config is not None and a.step is not None:
            p.error("--step picks a run directory's checkpoint; a committed state holds one step")
        export(a.run_dir, a.out, layout=a.layout or "both", dtype=a.dtype, step=a.step, config=a.config)


if __name__ == "__main__":
    main()

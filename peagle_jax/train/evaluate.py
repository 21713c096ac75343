"""Greedy acceptance of a trained head on held-out prompts.

    python -m peagle_jax.train.evaluate --run_dir ../runs/peagle_smollm2 [--head EXPORTED_DIR] \
        [--num_draft_tokens 5] [--prompts 16] [--max_new_tokens 128] [--batch 8]
    python -m peagle_jax.train.evaluate --config configs/train/peagle_qwen05.yaml [--head EXPORTED_DIR]

The run gives the target and the prompts. Its head is the run's latest checkpoint (`--run_dir`)
or the state it committed to the repository (`--config`, a fresh machine with no run directory);
`--head` measures an exported head instead, with the method its config says (P-EAGLE where it
drafts in parallel, else EAGLE-3), so heads of different methods are compared on one run's prompts.

Prompts are held out from training: for `data.source: generated` the first turns of the data
folder's val split (`generate_data --split val`, prompts the training split never saw), else
the validation split of the self-distillation prompts (stdlib functions held out by file),
rendered with the target's chat template. Prints one JSON line: mean acceptance length and
per-position acceptance rates (`speculative_generate`, greedy); `step` is the run checkpoint's
(null when `--head` names the head).
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m peagle_jax.train.evaluate")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run_dir", help="a training run directory")
    src.add_argument("--config", help="a training config (its committed state_dir: no run directory needed)")
    p.add_argument("--head", default=None, help="an exported head directory (default: the run's latest checkpoint, "
                   "or with --config its committed state)")
    p.add_argument("--num_draft_tokens", type=int, default=None)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args(argv)

    from pathlib import Path

    import yaml

    from peagle_jax.api import method_for
    from peagle_jax.checkpoints.drafter_io import load_drafter
    from peagle_jax.generate import speculative_generate
    from peagle_jax.train.config import TrainConfig
    from peagle_jax.train.data import encode_text, stdlib_function_prompts
    from peagle_jax.train.export import load_committed, load_trained
    from peagle_jax.train.features import load_target_and_tokenizer

    config = Path(a.config) if a.config else Path(a.run_dir) / "config.yaml"
    if not config.is_file():
        p.error(f"{config} does not exist" + ("" if a.config else " (--run_dir names a training run directory)"))
    cfg = TrainConfig.model_validate(yaml.safe_load(config.read_text()))
    target, tok, eos, _ = load_target_and_tokenizer(cfg)
    try:
        if a.head:  # the run gives the target and the prompts; the head and its method are the file's
            drafter, step = load_drafter(a.head, target=target), None
            method = method_for(drafter)
        else:
            drafter, target, cfg, step = (load_committed(a.config, target=target) if a.config
                                          else load_trained(a.run_dir, target=target))
            method = cfg.objective.method
    except FileNotFoundError as e:  # no head there, no committed state, no checkpoint
        p.error(str(e))
    k = a.num_draft_tokens or (cfg.objective.num_depths if method == "peagle" else cfg.objective.ttt_steps)
    if tok is None:
        rng = np.random.default_rng(123)
        prompts = [rng.integers(1, target.config.vocab_size - 1, 4).tolist() for _ in range(a.prompts)]
    elif cfg.data.source == "generated":
        prompts = held_out_prompts(cfg.data.generated_dir, a.prompts)
    else:
        pairs = stdlib_function_prompts(split="val", val_percent=cfg.data.val_percent, limit=a.prompts)
        prompts = [encode_text(tok, tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                             add_generation_prompt=True)).tolist() for _, q in pairs]
    acc = np.zeros(k)
    rounds = 0
    for s in range(0, len(prompts), a.batch):
        res = speculative_generate(target, drafter, prompts[s : s + a.batch], method=method, num_draft_tokens=k,
                                   max_new_tokens=a.max_new_tokens, eos_token_ids=eos)
        acc += res.accepted_per_position
        rounds += res.total_rounds
    print(json.dumps({"step": step, "head": a.head, "method": method, "num_draft_tokens": k, "prompts": len(prompts),
                      "mean_acceptance_length": float((rounds + acc.sum()) / max(rounds, 1)),
                      "acceptance_rate_per_position": (acc / max(rounds, 1)).round(4).tolist()}))


def held_out_prompts(generated_dir: str, count: int) -> list[list[int]]:
    """The first `count` first-turn prompts of a generate_data folder's val split, spread over
    its domains in the order the generator wrote them (its prompts are shuffled once)."""
    from pathlib import Path

    from peagle_jax.train.shards import read_split

    return [list(r.prompt) for r in read_split(Path(generated_dir), "val") if r.turn == 1][:count]


if __name__ == "__main__":
    main()

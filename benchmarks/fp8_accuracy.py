"""Accuracy cost of bf16 and FP8 on SmolLM2-135M-Instruct: FP8 KV cache, FP8 (e4m3) linear weights.

Reports, against the fp32 model: max / mean absolute logit error over real prompts, top-1
agreement of next-token predictions, greedy continuation agreement (tokens until the first
divergence), and, when a trained head is given, the change in mean acceptance length. With
`--hf`, every variant's logits are also compared with transformers' float32 forward of the same
weights (the parity oracle): that shows how far bf16 moves from the reference implementation, and
that our fp32 row is transformers' up to float rounding. `--dataset` takes the benchmark prompts
(HumanEval / MT-Bench chat) instead of the built-in coding questions.

  .venv/bin/python -m benchmarks.fp8_accuracy [--prompts 4] [--max-new-tokens 48] [--head DIR -k 5]
      [--dataset humaneval|mtbench] [--hf]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain what a Python decorator is, with an example.",
    "Write a function that merges two sorted lists into one sorted list.",
    "Write a binary search function in Python.",
]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a .gguf file or an HF directory (default: SmolLM2-135M)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--head", default=None, help="trained draft head for the acceptance comparison")
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=5)
    ap.add_argument("--dataset", default=None, choices=("humaneval", "mtbench"),
                    help="take the first --prompts prompts of this benchmark set (default: built-in questions)")
    ap.add_argument("--hf", action="store_true", help="also compare each variant with transformers (float32)")
    ap.add_argument("--out", default="results/fp8_accuracy")
    args = ap.parse_args(argv)

    from peagle_jax.api import load
    from peagle_jax.generate import speculative_generate

    def variant(name):
        return load(args.model, drafter=args.head, method="auto" if args.head else "none",
                    dtype="bfloat16" if name == "bf16" else "float32",
                    kv_cache_dtype="float8_e4m3fn" if name in ("fp8_kv", "fp8_kv+fp8_weights") else None,
                    fp8_weights=name in ("fp8_weights", "fp8_kv+fp8_weights"))

    base_llm = variant("fp32")
    eos = base_llm.eos_ids
    if args.dataset:
        from benchmarks import common

        prompts = [common.encode_prompt(base_llm.tokenizer, it)
                   for it in common.load_prompts(args.dataset, limit=args.prompts)]
    else:
        prompts = [base_llm.encode_chat(text) for text in PROMPTS[: args.prompts]]

    def full_logits(m, ids):
        t = jnp.asarray([ids])
        return np.asarray(m(t, jnp.arange(len(ids))[None], m.init_cache(1, max(1024, len(ids)))).logits[0])

    base = base_llm.target
    base_out = speculative_generate(base, None, prompts, method="none", max_new_tokens=args.max_new_tokens,
                                    eos_token_ids=eos)
    # Score each variant on the fp32 model's own continuations (prompt + its greedy answer).
    seqs = [p + t for p, t in zip(prompts, base_out.tokens, strict=True)]
    base_logits = [full_logits(base, s) for s in seqs]
    hf_logits = hf_reference_logits(base_llm.model_path, seqs) if args.hf else None
    rows = []
    for name in ("fp32", "bf16", "fp8_kv", "fp8_weights", "fp8_kv+fp8_weights"):
        llm = base_llm if name == "fp32" else variant(name)
        m = llm.target
        errs, agree, logits = [], [], []
        for s, bl in zip(seqs, base_logits, strict=True):
            lg = full_logits(m, s)
            logits.append(lg)
            errs.append(np.abs(lg - bl))
            agree.append(np.mean(lg.argmax(-1) == bl.argmax(-1)))
        out = speculative_generate(m, None, prompts, method="none", max_new_tokens=args.max_new_tokens,
                                   eos_token_ids=eos)
        # Continuations may stop (EOS) at different lengths: compare up to the shorter one.
        same_prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
                       for x, y in zip(out.tokens, base_out.tokens, strict=True)]
        row = dict(variant=name, max_abs_logit_error=float(max(e.max() for e in errs)),
                   mean_abs_logit_error=float(np.mean([e.mean() for e in errs])),
                   top1_agreement=float(np.mean(agree)), greedy_tokens_before_divergence=same_prefix)
        if hf_logits is not None:
            hf_errs = [np.abs(lg - hl) for lg, hl in zip(logits, hf_logits, strict=True)]
            row.update(hf_max_abs_logit_error=float(max(e.max() for e in hf_errs)),
                       hf_mean_abs_logit_error=float(np.mean([e.mean() for e in hf_errs])),
                       hf_top1_agreement=float(np.mean([np.mean(lg.argmax(-1) == hl.argmax(-1))
                                                        for lg, hl in zip(logits, hf_logits, strict=True)])))
        if args.head:
            r = llm.generate(prompts, num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens)
            row["mean_acceptance_length"] = r.mean_acceptance_length
        rows.append(row)
        print(json.dumps(row))
    write_report(rows, Path(args.out), hf=args.hf, head=bool(args.head))
    return rows


def write_report(rows: list[dict], out_dir: Path, *, hf: bool, head: bool) -> None:
    """fp8_accuracy.json and a markdown table of the variants."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fp8_accuracy.json").write_text(json.dumps(rows, indent=2))
    cols = ["variant", "max_abs_logit_error", "mean_abs_logit_error", "top1_agreement"] + (
        ["hf_max_abs_logit_error", "hf_mean_abs_logit_error", "hf_top1_agreement"] if hf else []) + (
        ["mean_acceptance_length"] if head else [])
    md = ["| " + " | ".join(cols) + " | greedy tokens before divergence |", "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        md.append("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols)
                  + f" | {r['greedy_tokens_before_divergence']} |")
    (out_dir / "fp8_accuracy.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def hf_reference_logits(model_path, seqs: list[list[int]]) -> list[np.ndarray]:
    """transformers' float32 logits [T, V] for each full sequence (one causal forward each)."""
    import torch

    from benchmarks.peer_hf import load_hf

    hf = load_hf(model_path)
    with torch.inference_mode():
        return [hf(torch.tensor([s])).logits[0].float().numpy() for s in seqs]


if __name__ == "__main__":
    main()

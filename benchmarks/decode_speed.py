"""Greedy decode speed: peagle-jax (`speculative_generate(method="none")`) vs HF transformers.

Same SmolLM2-135M-Instruct GGUF weights, fp32, batch 1, same chat prompts and token budget.
Methods are interleaved prompt by prompt so both see the same machine state; compilation is
excluded (one warm-up call per shape). Writes JSON + Markdown to results/decode_speed/.

  .venv/bin/python -m benchmarks.decode_speed [--max-new-tokens 128] [--prompts 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from peagle_jax.api import chat_ids

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Write a Python function to check whether a number is prime.",
    "Explain what a Python decorator is, with an example.",
    "Write a function that merges two sorted lists into one sorted list.",
    "How do I read a CSV file in Python?",
    "Write a binary search function in Python.",
]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a .gguf file or an HF directory (default: SmolLM2-135M)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--out", default="results/decode_speed")
    args = ap.parse_args(argv)

    import torch

    from benchmarks.peer_hf import load_hf
    from peagle_jax.api import load
    from peagle_jax.generate import speculative_generate

    llm = load(args.model, method="none", dtype="float32")
    ours, tok, path = llm.target, llm.tokenizer, llm.model_path
    hf = load_hf(path)  # the same file (GGUF dequantised to fp32) or directory
    # Both sides ignore EOS and generate exactly n tokens (min_new_tokens would instead mask
    # the EOS logit and change the tokens), so tokens/s and the token check compare like for like.
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = tok.pad_token_id
    n = args.max_new_tokens
    rows = []
    for text in PROMPTS[: args.prompts]:
        ids = chat_ids(tok, text)
        speculative_generate(ours, None, [ids], method="none", max_new_tokens=n, eos_token_ids=[])  # compile
        t0 = time.perf_counter()
        r = speculative_generate(ours, None, [ids], method="none", max_new_tokens=n, eos_token_ids=[])
        t_ours = time.perf_counter() - t0
        with torch.inference_mode():
            x = torch.tensor([ids])
            # An explicit mask: without one, generate masks every prompt token equal to the pad
            # id, and SmolLM2's pad id is <|im_end|>, which every chat prompt contains.
            mask = torch.ones_like(x)
            hf.generate(x, attention_mask=mask, max_new_tokens=4, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            y = hf.generate(x, attention_mask=mask, max_new_tokens=n, do_sample=False)
            t_hf = time.perf_counter() - t0
        same = y[0, len(ids):].tolist() == r.tokens[0]
        rows.append(dict(prompt=text, tokens=n, ours_tok_s=n / t_ours, hf_tok_s=n / t_hf, identical_tokens=same))
        print(f"{text[:40]:40s} ours {n / t_ours:6.1f} tok/s  transformers {n / t_hf:6.1f} tok/s  same={same}")
    ours_mean = sum(r["ours_tok_s"] for r in rows) / len(rows)
    hf_mean = sum(r["hf_tok_s"] for r in rows) / len(rows)
    summary = dict(
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), python=platform.python_version()),
        max_new_tokens=n, ours_tok_s=ours_mean, transformers_tok_s=hf_mean, speedup=ours_mean / hf_mean, rows=rows,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_speed.json").write_text(json.dumps(summary, indent=2))
    md = ["| prompt | peagle-jax tok/s | transformers tok/s | identical |", "|---|---|---|---|"]
    md += [f"| {r['prompt'][:50]} | {r['ours_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['identical_tokens']} |"
           for r in rows]
    md.append(f"| **mean** | **{ours_mean:.1f}** | **{hf_mean:.1f}** | speed-up {ours_mean / hf_mean:.2f}x |")
    (out / "decode_speed.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return summary


if __name__ == "__main__":
    main()

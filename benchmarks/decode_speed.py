"""Greedy decode speed: peagle-jax (`speculative_generate(method="none")`) vs HF transformers.

Same SmolLM2-135M-Instruct GGUF weights, batch 1, same chat prompts and token budget. Ours runs
in each of `--dtypes`: bf16 (the default, with the CPU matmul kernel `kernels_cpu`),
"bfloat16/xla" (bf16 on XLA's matmuls) and float32; transformers runs in float32 (its CPU
default). Methods are interleaved prompt by prompt so all see the same machine
state; compilation is excluded (one warm-up call per shape). The token check compares ours in
float32 with transformers (same arithmetic); bf16 may part from them at a near-tie. Writes JSON
+ Markdown to results/decode_speed/.

  .venv/bin/python -m benchmarks.decode_speed [--max-new-tokens 128] [--prompts 4]
      [--dtypes bfloat16 bfloat16/xla float32]
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


CONFIGS = ("bfloat16", "bfloat16/xla", "float32")  # dtype[/matmul]; no suffix: load's default ("auto")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a .gguf file or an HF directory (default: SmolLM2-135M)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--dtypes", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                    help="our inference dtypes (dtype[/matmul path]), each timed beside transformers (float32)")
    ap.add_argument("--out", default="results/decode_speed")
    args = ap.parse_args(argv)

    import torch

    from benchmarks.peer_hf import load_hf
    from peagle_jax.api import load
    from peagle_jax.generate import speculative_generate

    ours = {d: load(args.model, method="none", dtype=d.split("/")[0], matmul=(d.split("/") + ["auto"])[1])
            for d in args.dtypes}
    first = next(iter(ours.values()))
    tok, path = first.tokenizer, first.model_path
    hf = load_hf(path)  # the same file (GGUF dequantised to fp32) or directory
    # Both sides ignore EOS and generate exactly n tokens (min_new_tokens would instead mask
    # the EOS logit and change the tokens), so tokens/s and the token check compare like for like.
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = tok.pad_token_id
    n = args.max_new_tokens
    kw = dict(method="none", max_new_tokens=n, eos_token_ids=[])
    rows = []
    for text in PROMPTS[: args.prompts]:
        ids = chat_ids(tok, text)
        row = dict(prompt=text, tokens=n)
        for d, llm in ours.items():
            speculative_generate(llm.target, None, [ids], **kw)  # compile
            t0 = time.perf_counter()
            r = speculative_generate(llm.target, None, [ids], **kw)
            row[f"ours_{d}_tok_s"] = n / (time.perf_counter() - t0)
            row[f"ours_{d}_tokens"] = r.tokens[0]
        with torch.inference_mode():
            x = torch.tensor([ids])
            # An explicit mask: without one, generate masks every prompt token equal to the pad
            # id, and SmolLM2's pad id is <|im_end|>, which every chat prompt contains.
            mask = torch.ones_like(x)
            hf.generate(x, attention_mask=mask, max_new_tokens=4, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            y = hf.generate(x, attention_mask=mask, max_new_tokens=n, do_sample=False)
            row["hf_tok_s"] = n / (time.perf_counter() - t0)
        hf_tokens = y[0, len(ids):].tolist()
        for d in args.dtypes:
            row[f"ours_{d}_identical_to_hf"] = row.pop(f"ours_{d}_tokens") == hf_tokens
        rows.append(row)
        print(f"{text[:40]:40s} " + "  ".join(f"ours {d} {row[f'ours_{d}_tok_s']:6.1f}" for d in args.dtypes)
              + f"  transformers {row['hf_tok_s']:6.1f} tok/s")

    def mean(key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    hf_mean = mean("hf_tok_s")
    summary = dict(
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), python=platform.python_version()),
        max_new_tokens=n, transformers_tok_s=hf_mean, rows=rows,
        ours={d: dict(tok_s=mean(f"ours_{d}_tok_s"), speedup=mean(f"ours_{d}_tok_s") / hf_mean,
                      identical_to_hf=sum(r[f"ours_{d}_identical_to_hf"] for r in rows)) for d in args.dtypes},
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_speed.json").write_text(json.dumps(summary, indent=2))
    md = ["| prompt | " + " | ".join(f"peagle-jax {d} tok/s (same tokens as HF)" for d in args.dtypes)
          + " | transformers float32 tok/s |", "|---|" + "---|" * (len(args.dtypes) + 1)]
    md += [f"| {r['prompt'][:50]} | " + " | ".join(
        f"{r[f'ours_{d}_tok_s']:.1f} ({'yes' if r[f'ours_{d}_identical_to_hf'] else 'no'})" for d in args.dtypes)
        + f" | {r['hf_tok_s']:.1f} |" for r in rows]
    md.append("| **mean** | " + " | ".join(
        f"**{summary['ours'][d]['tok_s']:.1f}** ({summary['ours'][d]['speedup']:.2f}x transformers)"
        for d in args.dtypes) + f" | **{hf_mean:.1f}** |")
    (out / "decode_speed.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return summary


if __name__ == "__main__":
    main()

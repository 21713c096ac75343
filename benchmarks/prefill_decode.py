"""Prefill and decode speed, load time and memory of a target per weight path (`Options.target_weights`).

    python -m benchmarks.prefill_decode --model qwen2.5-coder-1.5b-instruct --weights file bf16

For each weight path in turn, in a fresh process: the load time and the process's resident
memory once loaded; prompt tokens/s of a prefill (HumanEval chat prompts,
one at a time, timed as a 1-token generate); and plain greedy decode tokens/s at each batch size
(the prompts' first 16 tokens, repeated to fill the batch, `--tokens` new tokens, the
prefill's time taken off). Every program is run once before it is timed, so compilation is excluded.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks import common

DECODE_PROMPT_TOKENS = 16  # the decode measurement's prompts: each HumanEval prompt's first tokens


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(model: str | None, weights: str, prompts: list[dict], batch_sizes: list[int], tokens: int) -> dict:
    from peagle_jax import load

    t = time.perf_counter()
    llm = load(model, method="none", target_weights=weights)
    row: dict[str, Any] = dict(weights=llm.options.get("target_weights", weights), load_s=time.perf_counter() - t,
                               rss_mb=common.rss_mb())
    ids = [common.encode_prompt(llm.tokenizer, item) for item in prompts]
    one = lambda batch, n: llm.generate(batch, max_new_tokens=n, eos_token_ids=[])  # noqa: E731
    prefill_s = 0.0
    for p in ids:
        one([p], 1)
        prefill_s += _timed(lambda p=p: one([p], 1))
    row["prompt_tokens"] = sum(map(len, ids))
    row["prefill_tok_s"] = row["prompt_tokens"] / prefill_s
    for b in batch_sizes:  # short prompts: a batch's prefill is taken off, but costs run time
        batch = [ids[i % len(ids)][:DECODE_PROMPT_TOKENS] for i in range(b)]
        one(batch, 1)  # both programs compiled before either is timed
        one(batch, tokens)
        first = _timed(lambda batch=batch: one(batch, 1))
        total = _timed(lambda batch=batch: one(batch, tokens))
        row[f"decode_tok_s_b{b}"] = b * (tokens - 1) / (total - first)
    row["rss_mb_after"] = common.rss_mb()
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default=None, help="a .gguf or a model name (default: the default model)")
    ap.add_argument("--weights", nargs="+", default=["file", "bf16"], choices=("auto", "file", "bf16"))
    ap.add_argument("--limit", type=int, default=3, help="HumanEval chat prompts")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=17, help="new tokens per decode measurement")
    ap.add_argument("--out", default="results/prefill_decode")
    args = ap.parse_args(argv)
    prompts = common.load_prompts("humaneval", limit=args.limit)
    import multiprocessing

    rows = []
    for weights in args.weights:  # a fresh process each, so its memory is its own
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            rows.append(pool.apply(measure, (args.model, weights, prompts, args.batch_sizes, args.tokens)))
        print(rows[-1], flush=True)
    summary = dict(benchmark="prefill_decode", model=args.model or "default", settings=vars(args),
                   machine=common.machine_info(), results=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "prefill_decode.json", summary)
    heads = ["weights", "load s", "RSS MB", "prefill tok/s"] + [f"decode tok/s B={b}" for b in args.batch_sizes]
    md = [f"# Prefill and decode by weight path: {args.model or 'default'}", "",
          f"`python -m benchmarks.prefill_decode --model {args.model or 'default'} --weights {' '.join(args.weights)} "
          f"--limit {args.limit} --batch-sizes {' '.join(map(str, args.batch_sizes))} --tokens {args.tokens}`", "",
          common.md_table(heads, [[r["weights"], f"{r['load_s']:.0f}", f"{r['rss_mb']:.0f}",
                                   f"{r['prefill_tok_s']:.1f}"]
                                  + [f"{r[f'decode_tok_s_b{b}']:.1f}" for b in args.batch_sizes] for r in rows]),
          "", common.machine_md(summary["machine"]), ""]
    (out / "prefill_decode.md").write_text("\n".join(md))
    print("\n".join(md))
    return summary


if __name__ == "__main__":
    main()

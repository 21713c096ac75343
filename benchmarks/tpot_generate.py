"""`speculative_generate`'s time per output token on the prompts of `benchmarks.mixed_batch`: the
reference a server's TPOT at concurrency 1 is held to (#17 asks for at most 1.3x).

  .venv/bin/python -m benchmarks.tpot_generate [--methods none eagle3 peagle] [--k 3] \
      [--peagle-head DIR] [--eagle3-head DIR] \
      [--repeats 6] [--max-tokens 96] [--dataset mtbench] [--out results/tpot_generate]

For each of the prompts mixed_batch measures (chat-encoded, batch 1, greedy), every method
generates `--max-tokens` tokens and, separately, one token (prefill plus the first token):
TPOT = (t(max) - t(1)) / (tokens - 1), the time per token after the first, as a server's
streaming TPOT is. Every shape is compiled by an untimed call first; methods interleave per
prompt. Writes results/tpot_generate/tpot_generate.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["none", "eagle3", "peagle"], choices=["none", "eagle3", "peagle"])
    ap.add_argument("--peagle-head", default="assets/heads/smollm2-135m-peagle")
    ap.add_argument("--eagle3-head", default="assets/heads/smollm2-135m-eagle3")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per round")
    ap.add_argument("--repeats", type=int, default=6, help="prompts, as mixed_batch's repeats take them")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dataset", default="mtbench", choices=common.DATASETS)
    ap.add_argument("--out", default="results/tpot_generate")
    a = ap.parse_args(argv)
    if a.k < 1 or a.repeats < 1 or a.max_tokens < 2:
        ap.error("--k >= 1, --repeats >= 1 and --max-tokens >= 2")
    return a


def _timed(target, drafter, method: str, k: int, ids: list[int], n: int, eos) -> tuple[float, int]:
    from peagle_jax.generate import speculative_generate

    t0 = time.perf_counter()
    r = speculative_generate(target, drafter, [ids], method=method, num_draft_tokens=k, max_new_tokens=n,
                             eos_token_ids=eos)
    return time.perf_counter() - t0, int(r.lengths[0])


def run(args) -> dict[str, Any]:
    from peagle_jax.api import load

    llm = load("default", method="none", dtype="bfloat16")
    heads = {"peagle": args.peagle_head, "eagle3": args.eagle3_head}
    drafters = {m: llm.load_head(heads[m]) if m in heads else None for m in args.methods}
    items = common.load_prompts(args.dataset)
    # mixed_batch's repeat r measures prompt (r + 1) % len(prompts)
    prompts = [common.encode_prompt(llm.tokenizer, items[(r + 1) % len(items)]) for r in range(args.repeats)]
    tpot: dict[str, list[float]] = {m: [] for m in args.methods}
    for ids in prompts:
        for m in args.methods:  # compile this prompt bucket for both lengths, untimed
            for n in (1, args.max_tokens):
                _timed(llm.target, drafters[m], m, args.k, ids, n, llm.eos_ids)
        for m in args.methods:
            t_full, tokens = _timed(llm.target, drafters[m], m, args.k, ids, args.max_tokens, llm.eos_ids)
            t_first, _ = _timed(llm.target, drafters[m], m, args.k, ids, 1, llm.eos_ids)
            if tokens > 1:
                tpot[m].append((t_full - t_first) / (tokens - 1))
    return dict(methods=args.methods, k=args.k, max_tokens=args.max_tokens, dataset=args.dataset,
                prompts=len(prompts), tpot_ms={m: 1e3 * float(np.median(v)) for m, v in tpot.items() if v},
                tpot_ms_each={m: [1e3 * x for x in v] for m, v in tpot.items()}, machine=common.machine_info())


def write_report(summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tpot_generate.json").write_text(json.dumps(summary, indent=2))
    rows = [[m, "–" if m == "none" else summary["k"], f"{v:.1f}"] for m, v in summary["tpot_ms"].items()]
    md = [f"# speculative_generate TPOT, batch 1 ({summary['dataset']} prompts of mixed_batch, "
          f"{summary['prompts']} prompts, {summary['max_tokens']} tokens, greedy, bf16)", "",
          common.md_table(["method", "K", "median TPOT ms"], rows), "", "## Machine", ""]
    md += [f"- {k}: {v}" for k, v in summary["machine"].items()]
    (out / "tpot_generate.md").write_text("\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    summary = run(args)
    write_report(summary, Path(args.out))
    print(json.dumps(summary["tpot_ms"]))
    return summary


if __name__ == "__main__":
    main()

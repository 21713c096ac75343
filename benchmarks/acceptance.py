"""Acceptance-length table: P-EAGLE vs EAGLE-3 heads x K on HumanEval and MT-Bench coding, greedy.

Acceptance length (tokens per target forward) does not depend on timing, so prompts run in
large batches. Every speculative output is checked token-identical to plain greedy decoding
(method "none") of the same prompts.

  .venv/bin/python -m benchmarks.acceptance --peagle-head assets/heads/smollm2-135m-peagle \
      --eagle3-head assets/heads/smollm2-135m-eagle3 [--ks 3 5 7] [--max-new-tokens 128] [--batch 32]

Writes results/acceptance/acceptance.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.common import encode_prompt, load_prompts, machine_info, md_table, write_json


def run(target, drafter, prompts, *, method, k, max_new, batch, eos, bucket):
    """Generate for all prompts; returns tokens and per-sequence (rounds [N], accepted [N, K])."""
    from peagle_jax.generate import speculative_generate

    n = len(prompts)
    tokens, rounds, hist = [], np.zeros(n, np.int64), np.zeros((n, max(k, 1)), np.int64)
    for s in range(0, n, batch):
        chunk = prompts[s : s + batch]
        # Fill the last batch with repeats so every call has the same shape (one compilation).
        padded = chunk + prompts[: batch - len(chunk)]
        r = speculative_generate(target, drafter, padded, method=method, num_draft_tokens=max(k, 1),
                                 max_new_tokens=max_new, eos_token_ids=eos, min_bucket=bucket)
        m = len(chunk)
        tokens += r.tokens[:m]
        if method != "none":
            rounds[s : s + m] = r.rounds[:m]
            hist[s : s + m] = r.accepted_per_sequence[:m]
    return tokens, rounds, hist


def summarize(rounds, hist) -> tuple[float, list[float]]:
    total = rounds.sum()
    return float((total + hist.sum()) / total), (hist.sum(axis=0) / total).tolist()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="target: a .gguf file or an HF directory (default SmolLM2-135M)")
    ap.add_argument("--peagle-head", required=True)
    ap.add_argument("--eagle3-head", required=True)
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each set (default: all)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--out", default="results/acceptance")
    a = ap.parse_args(argv)

    from peagle_jax.api import load

    llm = load(a.model, drafter=a.peagle_head, method="peagle", dtype=a.dtype)
    target, tok, eos = llm.target, llm.tokenizer, llm.eos_ids
    heads = {"peagle": llm.drafter, "eagle3": llm.load_head(a.eagle3_head)}
    humaneval = load_prompts("humaneval", limit=a.limit)
    coding = load_prompts("mtbench", category="coding", limit=a.limit)
    sets = {f"HumanEval ({len(humaneval)})": humaneval, f"MT-Bench coding ({len(coding)})": coding}
    # One prompt list and one prompt bucket for everything: each (method, K) compiles once.
    names = [name for name, items in sets.items() for _ in items]
    prompts = [encode_prompt(tok, it) for items in sets.values() for it in items]
    from peagle_jax.generate import prompt_bucket

    bucket = prompt_bucket(max(len(p) for p in prompts))
    results, t0 = [], time.time()
    ref, _, _ = run(target, None, prompts, method="none", k=0, max_new=a.max_new_tokens, batch=a.batch, eos=eos,
                    bucket=bucket)
    for k in a.ks:
        for method in ("eagle3", "peagle"):
            out, rounds, hist = run(target, heads[method], prompts, method=method, k=k, max_new=a.max_new_tokens,
                                    batch=a.batch, eos=eos, bucket=bucket)
            for name in sets:
                idx = np.array([i for i, nm in enumerate(names) if nm == name])
                al, per = summarize(rounds[idx], hist[idx])
                mismatches = sum(out[i] != ref[i] for i in idx)
                results.append(dict(dataset=name, method=method, k=k, acceptance_length=al, per_position=per,
                                    prompts=len(idx), mismatches_vs_greedy=int(mismatches)))
                print(json.dumps(results[-1]), flush=True)
    out = Path(a.out)
    summary = dict(machine=machine_info(), dtype=a.dtype, max_new_tokens=a.max_new_tokens,
                   heads=dict(peagle=a.peagle_head, eagle3=a.eagle3_head), wall_time_s=time.time() - t0,
                   results=results)
    write_json(out / "acceptance.json", summary)
    rows = [[r["dataset"], r["method"], r["k"], f"{r['acceptance_length']:.2f}",
             " / ".join(f"{p:.2f}" for p in r["per_position"]), r["mismatches_vs_greedy"]] for r in results]
    md = md_table(["prompts", "method", "K", "acceptance length", "per-position acceptance", "mismatches"], rows)
    (out / "acceptance.md").write_text(md + "\n")
    print(md)
    return summary


if __name__ == "__main__":
    main()

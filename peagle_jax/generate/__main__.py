"""`python -m peagle_jax.generate`: generate text with or without speculative decoding.

Examples:
  python -m peagle_jax.generate --chat --prompt "Write a Python function that reverses a string."
  python -m peagle_jax.generate --chat --prompt "..." --drafter assets/heads/smollm2-peagle --method peagle -k 7
"""

from __future__ import annotations

import argparse
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m peagle_jax.generate", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--model", default=None, help="a .gguf file or an HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None,
                   help="draft head directory (AWS/EAGLE-3 or speculators layout); default model: the shipped head")
    p.add_argument("--method", choices=("none", "eagle3", "peagle"), default=None,
                   help="default: peagle for a parallel-drafting head, eagle3 for a sequential one, none without --drafter")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=5)
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
    p.add_argument("--attention", choices=("xla", "triton", "mosaic", "auto"), default=None,
                   help="cache-attention implementation (Pallas kernels on GPU; default: XLA reference)")
    p.add_argument("--kv-cache-dtype", choices=("float32", "bfloat16", "float8_e4m3fn"), default=None)
    p.add_argument("--fp8-weights", action="store_true", help="store target linear weights in FP8 (e4m3)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up call (then tokens/s includes compilation)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens <= 0:
        print("error: --max-new-tokens must be positive", file=sys.stderr)
        return 2
    if args.num_draft_tokens < 1:
        print("error: --num-draft-tokens must be >= 1", file=sys.stderr)
        return 2
    from peagle_jax.checkpoints import load_target
    from peagle_jax.checkpoints.default_model import resolve_model_path
    from peagle_jax.checkpoints.tokenizer import eos_token_ids, load_tokenizer
    from peagle_jax.generate import speculative_generate
    from peagle_jax.sharding import make_mesh, maybe_initialize_distributed, shard_module

    maybe_initialize_distributed()
    try:
        model_path = resolve_model_path(args.model)
        mesh = make_mesh(args.mesh)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    target = load_target(model_path, dtype=args.dtype)
    tokenizer = load_tokenizer(model_path)
    drafter = None
    method = args.method or "none"
    if args.drafter is None and args.model in (None, "default") and args.method in (None, "peagle", "eagle3"):
        # The default model ships with trained heads: use them unless told otherwise.
        from peagle_jax.checkpoints.default_model import default_drafter_path

        shipped = default_drafter_path(args.method or "peagle")
        if shipped is not None:
            args.drafter = str(shipped)
            print(f"using the shipped draft head {shipped.name} (--method none to decode without it)", file=sys.stderr)
    if args.drafter:
        from peagle_jax.checkpoints.drafter_io import load_drafter

        drafter = load_drafter(args.drafter, target=target, dtype=args.dtype)
        if args.method is None:
            method = "peagle" if drafter.config.parallel_drafting else "eagle3"
    elif method != "none":
        print(f"error: --method {method} needs --drafter", file=sys.stderr)
        return 2
    from peagle_jax.models.options import configure_inference, quantize_weights_fp8

    if args.fp8_weights:
        quantize_weights_fp8(target)
    for module in (target, drafter):
        if module is not None:
            configure_inference(module, attention=args.attention, kv_cache_dtype=args.kv_cache_dtype)
            shard_module(module, mesh)
    print(f"loaded {model_path.name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    prompts = []
    for text in args.prompt:
        if args.chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer.encode(text)
        prompts.append(list(ids))
    kwargs = dict(
        method=method, num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        eos_token_ids=eos_token_ids(tokenizer, model_path), seed=args.seed,
    )
    if not args.no_warmup:
        t0 = time.perf_counter()
        speculative_generate(target, drafter, prompts, **kwargs)
        print(f"compiled and warmed up in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    t0 = time.perf_counter()
    result = speculative_generate(target, drafter, prompts, **kwargs)
    elapsed = time.perf_counter() - t0
    for i, toks in enumerate(result.tokens):
        if len(prompts) > 1:
            print(f"--- [{i}] ({result.finish_reasons[i]})")
        print(tokenizer.decode(toks, skip_special_tokens=True))
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

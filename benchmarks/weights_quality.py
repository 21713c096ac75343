"""How close a quantized GGUF target runs to its float32 dequantized model, per weight path.

    python -m benchmarks.weights_quality --model qwen2.5-coder-1.5b-instruct --limit 8 --tokens 64

For each prompt (HumanEval chat prompts for code, MT-Bench first turns for chat), the float32
dequantized model (XLA matmuls) writes a greedy reference continuation. Each variant then reads
prompt and continuation teacher-forced, in chunks of 16 rows (decode-sized: the CPU kernel's path,
as in a decode step or a verify), and is scored per continuation token against the reference:

- greedy agreement: the share of tokens where the variant's argmax is the reference token;
- logit error: the RMS and the largest |logit - reference logit|, over the whole vocabulary.

Variants: `file` (Options.target_weights: the file's own blocks, gemv_group.cc) and `bf16` (the
weights dequantized, then rounded to bf16). Writes `weights_quality.json` and `.md` to --out.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks import common

CHUNK = 16  # rows per teacher-forced call: within the CPU kernel's decode-sized calls


def teacher_forced_logits(llm, tokens: list[int]) -> np.ndarray:
    """Float32 logits [len(tokens), V] of every position, fed CHUNK rows a call through a KV cache."""
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(llm.target)
    capacity = (len(tokens) + CHUNK - 1) // CHUNK * CHUNK
    cache = llm.target.init_cache(1, capacity)
    padded = list(tokens) + [0] * (capacity - len(tokens))
    logits = []
    for start in range(0, capacity, CHUNK):
        toks = jnp.asarray([padded[start:start + CHUNK]], jnp.int32)
        pos = jnp.arange(start, start + CHUNK, dtype=jnp.int32)[None]
        out, cache = _forward(graphdef, state, toks, pos, cache.with_lengths(jnp.asarray([start], jnp.int32)))
        logits.append(np.asarray(out[0], np.float32))
    return np.concatenate(logits)[:len(tokens)]


@functools.partial(jax.jit, static_argnums=0)  # one program per model and cache size, across prompts
def _forward(graphdef, state, tokens, positions, cache):
    from flax import nnx

    out = nnx.merge(graphdef, state)(tokens, positions, cache)
    return out.logits, out.cache


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default=None, help="a quantized .gguf or a model name (default: the default model)")
    ap.add_argument("--limit", type=int, default=8, help="prompts per domain")
    ap.add_argument("--tokens", type=int, default=64, help="reference tokens per prompt")
    ap.add_argument("--out", default="results/weights_quality")
    args = ap.parse_args(argv)
    from peagle_jax import load

    reference = load(args.model, method="none", dtype="float32", matmul="xla", target_weights="bf16")
    tok = reference.tokenizer
    prompts = {"code": common.load_prompts("humaneval", limit=args.limit),
               "chat": common.load_prompts("mtbench", limit=args.limit)}
    refs: dict[str, list[tuple[list[int], int, np.ndarray]]] = {}
    for domain, items in prompts.items():
        refs[domain] = []
        for item in items:
            ids = common.encode_prompt(tok, item)
            cont = list(reference.generate([ids], max_new_tokens=args.tokens, eos_token_ids=[]).tokens[0])
            seq = ids + cont
            refs[domain].append((seq, len(ids), teacher_forced_logits(reference, seq)))
    del reference
    rows = []
    for variant in ("file", "bf16"):
        llm = load(args.model, method="none", target_weights=variant)
        t0 = time.perf_counter()
        for domain, cases in refs.items():
            agree = total = 0
            sq, worst = [], 0.0
            for seq, n_prompt, ref_logits in cases:
                logits = teacher_forced_logits(llm, seq)
                # position p predicts token p + 1: score the continuation's predictions
                span = slice(n_prompt - 1, len(seq) - 1)
                agree += int(np.sum(np.argmax(logits[span], -1) == np.asarray(seq[n_prompt:])))
                total += len(seq) - n_prompt
                diff = logits[span] - ref_logits[span]
                sq.append(np.mean(diff * diff))
                worst = max(worst, float(np.abs(diff).max()))
            rows.append(dict(variant=variant, target_weights=llm.options["target_weights"], domain=domain,
                             prompts=len(cases), tokens=total, greedy_agreement=agree / total,
                             logit_rms_error=float(np.sqrt(np.mean(sq))), logit_max_error=worst))
        print(f"{variant}: {time.perf_counter() - t0:.0f} s", flush=True)
        del llm
    summary = dict(benchmark="weights_quality", model=args.model or "default", settings=vars(args),
                   machine=common.machine_info(), results=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "weights_quality.json", summary)
    md = [f"# Quantized weights against the float32 dequantized model: {args.model or 'default'}", "",
          f"`python -m benchmarks.weights_quality --model {args.model or 'default'} --limit {args.limit} "
          f"--tokens {args.tokens}`", "",
          common.md_table(["weights", "domain", "prompts", "tokens", "greedy agreement", "logit RMS error",
                           "largest logit error"],
                          [[r["target_weights"], r["domain"], r["prompts"], r["tokens"],
                            f"{100 * r['greedy_agreement']:.1f}%", f"{r['logit_rms_error']:.4f}",
                            f"{r['logit_max_error']:.3f}"] for r in rows]), ""]
    (out / "weights_quality.md").write_text("\n".join(md))
    print("\n".join(md))
    return summary


if __name__ == "__main__":
    main()

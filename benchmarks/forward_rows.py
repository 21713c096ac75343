"""Milliseconds per target forward by row count, and what the row-invariance measures cost.

A speculative round verifies K+1 rows where plain decoding runs 1, so the price of a row
decides where speculation breaks even. This times one jitted target forward over R rows at a
fixed context, for each R, under each combination of two switches (see docs/exactness.md,
"Exact in bf16"):
  * `step_jit`'s compiler option (YNN fusions limited to single dots), on / off: needed for
    row invariance;
  * row-wise cache attention for blocks of <= 16 rows, on / off: no longer needed (the batched
    heads-major attention is row-invariant, so it is off by default); kept to compare costs.
The no-one-row-dots measure is always on. Also reports whether row 0's logits are bitwise the
same for every R (they must be with the compiler option on). With `--matmuls cpu_kernel xla`
(the default) the same forwards also run on the CPU matmul kernel (`kernels_cpu`, load's
default for bf16 on CPU), in the default step setting (option on, row-wise attention off).

  .venv/bin/python -m benchmarks.forward_rows [--target default] [--dtype bfloat16]
      [--rows 1 2 4 8 16] [--context 256] [--repeats 20] [--matmuls cpu_kernel xla]
      [--out results/forward_rows]
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default", help="'default' (SmolLM2), a .gguf / HF dir, or 'tiny'")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--matmuls", nargs="+", default=["cpu_kernel", "xla"], choices=("cpu_kernel", "xla"),
                    help="matmul paths (load(matmul=...)); cpu_kernel is skipped where it cannot run")
    ap.add_argument("--out", default="results/forward_rows")
    a = ap.parse_args(argv)
    if a.context < 1 or a.repeats < 1 or any(r < 1 for r in a.rows):
        ap.error("--context, --repeats and --rows must be >= 1")
    return a


def time_forwards(target, rows: list[int], context: int, repeats: int, *, fusion_option: bool,
                  rowwise: bool) -> tuple[dict[int, float], dict[int, np.ndarray]]:
    """{R: median ms per forward}, {R: row 0's logits} for one configuration."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from peagle_jax.generate.speculative import cache_capacity
    from peagle_jax.generate.steps import STEP_COMPILER_OPTIONS
    from peagle_jax.kernels.attention import rowwise_rows

    with rowwise_rows(16 if rowwise else 0):  # read at trace time
        gdef, state = nnx.split(target)

        def forward(state, tokens, positions, cache):
            out = nnx.merge(gdef, state)(tokens, positions, cache)
            return out.logits, out.cache

        fwd = jax.jit(forward, compiler_options=STEP_COMPILER_OPTIONS if fusion_option else None)
        capacity = cache_capacity(context, max(rows), 0)
        rng = np.random.default_rng(0)
        prompt = jnp.asarray(rng.integers(1, target.config.vocab_size, (1, context)), jnp.int32)
        _, cache = fwd(state, prompt, jnp.arange(context)[None], target.init_cache(1, capacity))
        cache = cache.with_lengths(jnp.asarray([context]))
        ms, logits = {}, {}
        for r in rows:
            tokens = jnp.asarray(rng.integers(1, target.config.vocab_size, (1, r)), jnp.int32).at[0, 0].set(17)
            positions = jnp.asarray(context + np.arange(r))[None]
            out = jax.block_until_ready(fwd(state, tokens, positions, cache))  # compile
            logits[r] = np.asarray(out[0][0, 0])
            ms[r] = common.median_ms(fwd, state, tokens, positions, cache, repeats=repeats, warmup=0)
        return ms, logits


def run(args) -> dict[str, Any]:
    from peagle_jax.api import load
    from peagle_jax.models.options import choose_matmul, configure_inference

    results = []
    for matmul in args.matmuls:
        if args.target == "tiny":
            target = common.tiny_target(256, layers=2, dtype=args.dtype)
            path = choose_matmul(target, "auto" if matmul == "cpu_kernel" else "xla")
        else:
            llm = load(args.target, method="none", dtype=args.dtype, matmul="auto" if matmul == "cpu_kernel" else "xla")
            target, path = llm.target, llm.options["matmul"]
        if path != matmul:
            print(f"matmul {matmul}: not available here (XLA runs); skipped", flush=True)
            continue
        # The matmul kernel has no XLA fusion or row-wise switch to compare; it compares its
        # attention kernel ("cpu", load's default beside it) with the XLA reference instead.
        if matmul == "xla":
            combos = [(fusion, rowwise, None) for fusion, rowwise in itertools.product((True, False), (False, True))]
        else:
            default_attention = "cpu" if args.target == "tiny" else llm.options["attention"]
            combos = [(True, False, a) for a in dict.fromkeys((default_attention, "xla"))]
        for fusion_option, rowwise, attention_impl in combos:
            if attention_impl is not None:
                configure_inference(target, attention=attention_impl)
            ms, logits = time_forwards(target, args.rows, args.context, args.repeats,
                                       fusion_option=fusion_option, rowwise=rowwise)
            first = logits[args.rows[0]]
            invariant = all(np.array_equal(first, row) for row in logits.values())
            results.append({"matmul": matmul, "attention": attention_impl or "xla", "fusion_option": fusion_option,
                            "rowwise_attention": rowwise, "ms_per_forward": {str(r): v for r, v in ms.items()},
                            "row0_bitwise_invariant": invariant})
            print(f"{matmul:10s} attention {attention_impl or 'xla':4s} fusion option {fusion_option!s:5} row-wise "
                  f"{rowwise!s:5}: " + " ".join(f"{r}:{v:.1f}" for r, v in ms.items())
                  + f" ms; row 0 invariant: {invariant}", flush=True)
        del target
    return {"target": args.target, "dtype": args.dtype, "context": args.context, "repeats": args.repeats,
            "rows": args.rows, "machine": common.machine_info(), "results": results}


def write_report(summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "forward_rows.json", summary)
    rows = summary["rows"]
    table = [[r["matmul"], r.get("attention", "xla"), "on" if r["fusion_option"] else "off",
              "on" if r["rowwise_attention"] else "off",
              *[common.fmt(r["ms_per_forward"][str(n)], 1) for n in rows],
              "yes" if r["row0_bitwise_invariant"] else "NO"] for r in summary["results"]]
    md = [f"# ms per target forward by row count ({summary['target']}, {summary['dtype']}, "
          f"context {summary['context']}, median of {summary['repeats']})", "",
          common.md_table(["matmul", "attention", "step_jit option", "row-wise attention", *[f"{n} rows" for n in rows],
                           "row 0 bitwise equal for all row counts"], table),
          "", "## Machine", "", common.machine_md(summary["machine"]), ""]
    (out / "forward_rows.md").write_text("\n".join(md))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    summary = run(args)
    write_report(summary, Path(args.out))
    print((Path(args.out) / "forward_rows.md").read_text())
    return summary


if __name__ == "__main__":
    main()

"""Where a plain decode step's time goes: the weight matmuls against the memory roofline.

A decode step of a small model reads every weight once, so its floor is the time to stream
the weights from memory. This times, at the same R rows and on the model's own weights:
  * the whole target forward (`forward_rows.time_forwards`, the default step options);
  * the weight matmuls alone: every Linear kernel and the lm_head applied in layer order to
    R rows, nothing else (the part a faster GEMV kernel could shrink);
  * one pass reading all those weights (a sum in float32): the bandwidth this machine gives
    a plain XLA:CPU loop, i.e. the floor for a step.
#18's "plain decoding at least 2x transformers" was checked against these figures in
docs/notes/2026-12-03-session-15.md.
All of it runs on XLA's matmuls (`load(matmul="xla")`): this is the analysis that motivated the
CPU matmul kernel (`kernels_cpu`), which `benchmarks.forward_rows --matmuls` times against it.

  .venv/bin/python -m benchmarks.decode_roofline [--target default] [--rows 1 4 8]
      [--context 256] [--repeats 20] [--out results/decode_roofline]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks import common, forward_rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default", help="'default' (SmolLM2), a .gguf / HF dir, or 'tiny'")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="results/decode_roofline")
    a = ap.parse_args(argv)
    if a.context < 1 or a.repeats < 1 or any(r < 1 for r in a.rows):
        ap.error("--context, --repeats and --rows must be >= 1")
    return a


def weight_matrices(target) -> list[Any]:
    """The target's Linear kernels [in, out] in the order a forward reads them (the lm_head is
    `target.lm_head_weight()`, kept apart: tied to the embedding, it is read transposed)."""
    mats = []
    for layer in target.layers:
        attn, mlp = layer.self_attn, layer.mlp
        mats += [attn.q_proj.kernel[...], attn.k_proj.kernel[...], attn.v_proj.kernel[...], attn.o_proj.kernel[...]]
        mats += [p.kernel[...] for p in (getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
                 if p is not None and hasattr(p, "kernel")]
    return mats


def time_matmuls(target, rows: int, repeats: int) -> float:
    """ms for R rows through every weight matmul, each fed from the previous one's output."""
    import jax
    import jax.numpy as jnp

    from peagle_jax.generate.steps import STEP_COMPILER_OPTIONS
    from peagle_jax.models.layers import matmul

    mats, head = weight_matrices(target), target.lm_head_weight()

    def chain(x, mats, head):
        # each matmul takes the previous one's output (resized to its input width), as in the model
        for w in mats:
            xin = x if x.shape[-1] == w.shape[0] else jnp.resize(x, x.shape[:-1] + (w.shape[0],))
            x = matmul(xin, w) * 0.5
        xin = x if x.shape[-1] == head.shape[0] else jnp.resize(x, x.shape[:-1] + (head.shape[0],))
        return jnp.argmax(matmul(xin, head, out_dtype=jnp.float32), axis=-1)

    fn = jax.jit(chain, compiler_options=STEP_COMPILER_OPTIONS)
    x0 = jnp.ones((1, rows, mats[0].shape[0]), mats[0].dtype) * 0.01
    return common.median_ms(fn, x0, mats, head, repeats=repeats)


def time_weight_read(target, repeats: int) -> tuple[float, int]:
    """(ms, bytes) for one float32 sum over every matmul weight and the lm_head."""
    import jax
    import jax.numpy as jnp

    mats = weight_matrices(target) + [target.lm_head_weight()]
    fn = jax.jit(lambda ms: sum(jnp.sum(m.astype(jnp.float32)) for m in ms))
    return common.median_ms(fn, mats, repeats=repeats), sum(int(m.size) * m.dtype.itemsize for m in mats)


def run(args) -> dict[str, Any]:
    from peagle_jax.api import load

    if args.target == "tiny":
        target = common.tiny_target(256, layers=2, dtype=args.dtype)
    else:
        target = load(args.target, method="none", dtype=args.dtype, matmul="xla").target
    read_ms, nbytes = time_weight_read(target, args.repeats)
    step_ms, _ = forward_rows.time_forwards(target, args.rows, args.context, args.repeats,
                                            fusion_option=True, rowwise=False)
    rows = []
    for r in args.rows:
        mm = time_matmuls(target, r, args.repeats)
        rows.append({"rows": r, "forward_ms": step_ms[r], "matmuls_ms": mm,
                     "matmul_share": mm / step_ms[r], "matmul_gb_per_s": nbytes / mm / 1e6})
        print(f"{r} rows: forward {step_ms[r]:.1f} ms, matmuls alone {mm:.1f} ms "
              f"({nbytes / mm / 1e6:.1f} GB/s); weight read {read_ms:.1f} ms", flush=True)
    return {"target": args.target, "dtype": args.dtype, "context": args.context, "repeats": args.repeats,
            "weight_bytes": nbytes, "weight_read_ms": read_ms, "read_gb_per_s": nbytes / read_ms / 1e6,
            "rows": rows, "machine": common.machine_info()}


def write_report(summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "decode_roofline.json", summary)
    table = [[r["rows"], common.fmt(r["forward_ms"], 1), common.fmt(r["matmuls_ms"], 1),
              f"{100 * r['matmul_share']:.0f}%", common.fmt(r["matmul_gb_per_s"], 1)] for r in summary["rows"]]
    md = [f"# A forward against its weight matmuls and the weight-read floor ({summary['target']}, "
          f"{summary['dtype']}, context {summary['context']}, median of {summary['repeats']})", "",
          f"Weights read per forward: {summary['weight_bytes'] / 1e6:.0f} MB. One float32 sum over them: "
          f"{summary['weight_read_ms']:.1f} ms ({summary['read_gb_per_s']:.1f} GB/s), the floor of a step.", "",
          common.md_table(["rows", "forward ms", "weight matmuls alone ms", "matmuls' share", "matmul GB/s"], table),
          "", "## Machine", "", common.machine_md(summary["machine"]), ""]
    (out / "decode_roofline.md").write_text("\n".join(md))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    summary = run(args)
    write_report(summary, Path(args.out))
    print((Path(args.out) / "decode_roofline.md").read_text())
    return summary


if __name__ == "__main__":
    main()

"""What a round program costs to compile, and what XLA says it will cost to run, for a named
model shape at several depths: abstract weights only (`jax.ShapeDtypeStruct`), so nothing is
allocated and a 30B shape is measured on a laptop's CPU.

For each layer count and program (a plain decode step, an EAGLE-3 round at K=3 and a P-EAGLE
round at K=7, one random-shaped head each) it lowers the jitted round the decode loop and the
server run (`generate.steps.spec_round`, state donated) and compiles it, and prints

  COMPILE_S layers=N program=P seconds=S
  COST layers=N program=P flops=F bytes=B hlo_ops=O fusions=U retained_mb=M

`seconds` is the compile alone (lowering is reported beside it in the JSON); flops and bytes
are XLA's `cost_analysis()` of the compiled program (what one round computes and moves; under
`--layer-loop scan` it counts the loop body once, so one layer's share, not all of them);
hlo_ops and fusions count the optimized HLO's instructions and fusions (the unrolled layers
make both grow with depth); retained_mb is the process's resident memory the compile left
behind (noisy: a compile reuses what earlier ones freed; results/compile_cost/README.md).

  .venv/bin/python -m benchmarks.compile_cost --shape qwen3-30b-a3b --layers 12 48
      [--programs plain eagle3 peagle] [--batch 1] [--context 4096] [--dtype bfloat16]
      [--attention xla] [--moe dense|gathered|grouped] [--layer-loop unrolled|scan] [--peagle-layers 4]
      [--out results/compile_cost]

Writes <out>/compile_cost.{json,md} (each run replaces them).
"""

from __future__ import annotations

import argparse
import gc
import re
import time
from pathlib import Path
from typing import Any

from benchmarks import common

#: program name -> (method, K): the seed's comparison (plain decoding, EAGLE-3 K=3, P-EAGLE K=7).
PROGRAMS = {"plain": ("none", 0), "eagle3": ("eagle3", 3), "peagle": ("peagle", 7)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(common.SHAPES))
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=list(PROGRAMS))
    ap.add_argument("--batch", type=int, default=1, help="sequences per round (rows of the batch)")
    ap.add_argument("--context", type=int, default=4096, help="KV cache capacity per sequence")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--attention", default=None, help="cache attention (models.options.configure_inference); "
                    "default: auto on a GPU, xla elsewhere")
    ap.add_argument("--moe", default="dense", choices=("dense", "gathered", "grouped"),
                    help="MoE evaluation (models.layers.MoE), for MoE shapes")
    ap.add_argument("--layer-loop", default="unrolled", choices=("unrolled", "scan"),
                    help="the target's layers unrolled or under one scan (models.layer_stack)")
    ap.add_argument("--peagle-layers", type=int, default=4, help="P-EAGLE head depth (AWS ships 4)")
    ap.add_argument("--out", default="results/compile_cost")
    a = ap.parse_args(argv)
    if min(a.layers) < 1 or a.batch < 1 or a.context < 16 or a.peagle_layers < 1:
        ap.error("--layers, --batch and --peagle-layers must be >= 1 and --context >= 16")
    return a


def abstract_models(shape: str, layers: int, method: str, args: argparse.Namespace):
    """(target, drafter) with abstract weights: every array a ShapeDtypeStruct."""
    import jax
    from flax import nnx

    from peagle_jax.drafters import DrafterConfig, create_drafter
    from peagle_jax.models import create_model
    from peagle_jax.models.options import configure_inference

    positions = max(args.context, common.SHAPES[shape]["max_position_embeddings"])
    cfg = common.shape_config(shape, layers=layers, dtype=args.dtype, max_position_embeddings=positions)
    target = nnx.eval_shape(lambda: create_model(cfg, seed=0))
    attention = args.attention or ("auto" if jax.default_backend() == "gpu" else "xla")
    configure_inference(target, attention=attention, moe=args.moe, layer_loop=args.layer_loop)
    drafter = None
    if method != "none":
        parallel = method == "peagle"
        depth = args.peagle_layers if parallel else 1
        dcfg = DrafterConfig.for_target(cfg, num_layers=depth, parallel_drafting=parallel,
                                        mask_token_id=cfg.vocab_size - 1 if parallel else None)
        drafter = nnx.eval_shape(lambda: create_drafter(dcfg, seed=1))
        configure_inference(drafter, attention=attention)
    return target, drafter


def round_program(target, drafter, method: str, k: int, args: argparse.Namespace):
    """The jitted round and its abstract arguments (weights and a prefilled state)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from peagle_jax.generate.speculative import merge_models
    from peagle_jax.generate.steps import SpecConfig, prefill, spec_round, step_jit
    from peagle_jax.sampling import SamplingParams

    b, prompt = args.batch, 16
    budget = args.context - prompt - 2 * k - 2  # new tokens a sequence may still write
    config = SpecConfig(method, k, True, args.context, budget)
    target_def, target_state = nnx.split(target)
    drafter_def, drafter_state = nnx.split(drafter) if drafter is not None else (None, None)

    def init(ts, ds, tokens, lens):
        t, d = merge_models(target_def, ts, drafter_def, ds)
        return prefill(t, d, tokens, lens, config, max_new=jnp.full((b,), budget, jnp.int32),
                       sp=SamplingParams.full(b, 0.0, 0, 1.0), eos_ids=jnp.array([0], jnp.int32),
                       key=jax.random.split(jax.random.key(0), b))

    def one_round(ts, ds, state):
        t, d = merge_models(target_def, ts, drafter_def, ds)
        return spec_round(t, d, state, config)

    state = jax.eval_shape(init, target_state, drafter_state, jax.ShapeDtypeStruct((b, prompt), jnp.int32),
                           jax.ShapeDtypeStruct((b,), jnp.int32))
    return step_jit(one_round, donate_argnames=("state",)), (target_state, drafter_state, state)


def resident_mb() -> float:
    """Resident memory after handing freed heap back to the system (what stays is in use)."""
    from peagle_jax.serve.runner import release_free_memory

    release_free_memory()
    return common.rss_mb()


def _cost(compiled) -> dict[str, float]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"flops": float(cost.get("flops", 0.0)), "bytes": float(cost.get("bytes accessed", 0.0))}


def measure(shape: str, layers: int, name: str, args: argparse.Namespace, *, report: bool = True) -> dict[str, Any]:
    method, k = PROGRAMS[name]
    target, drafter = abstract_models(shape, layers, method, args)
    fn, fn_args = round_program(target, drafter, method, k, args)
    gc.collect()
    before = resident_mb()
    t0 = time.perf_counter()
    lowered = fn.lower(*fn_args)
    lower_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text() or ""
    row = dict(layers=layers, program=name, method=method, k=k, lower_s=round(lower_s, 2),
               compile_s=round(compile_s, 2), **_cost(compiled),
               hlo_ops=len(re.findall(r"^\s+(?:ROOT )?%\S+ = ", text, re.MULTILINE)),
               fusions=len(re.findall(r" fusion\(", text)), retained_mb=round(resident_mb() - before, 1))
    if not report:
        return row
    print(f"COMPILE_S layers={layers} program={name} seconds={compile_s:.2f}", flush=True)
    print(f"COST layers={layers} program={name} flops={row['flops']:.4g} bytes={row['bytes']:.4g} "
          f"hlo_ops={row['hlo_ops']} fusions={row['fusions']} retained_mb={row['retained_mb']}", flush=True)
    return row


def write_report(summary: dict[str, Any], out: Path) -> None:
    a = summary["settings"]
    lines = [f"# Round programs' compile cost: {a['shape']}, batch {a['batch']}, context {a['context']}, "
             f"{a['dtype']}, MoE {a['moe']}, layers {a['layer_loop']}, abstract weights", "",
             f"`{summary['command']}`", "",
             "| layers | program | lower s | compile s | GFLOP per round | GB moved per round | HLO ops | fusions "
             "| retained MB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        lines.append(f"| {r['layers']} | {r['program']} | {r['lower_s']} | {r['compile_s']} | {r['flops'] / 1e9:.2f} "
                     f"| {r['bytes'] / 1e9:.3f} | {r['hlo_ops']} | {r['fusions']} | {r['retained_mb']} |")
    if a["layer_loop"] == "scan":
        lines += ["", "Under the scan XLA's cost analysis has the loop body counted once: the GFLOP and GB "
                  "columns are one layer's, plus what runs outside the layers, not a round's."]
    lines += ["", "## Machine", ""] + [f"- {k}: {v}" for k, v in summary["machine"].items()]
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_cost.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import sys

    args = parse_args(argv)
    # Untimed: a process's first compile also pays XLA's one-time set-up (0.5 s on the CPU host,
    # which made the first row look slower than the same program compiled again).
    measure(args.shape, min(args.layers), args.programs[0], args, report=False)
    rows = [measure(args.shape, n, name, args) for n in args.layers for name in args.programs]
    summary = dict(command="python -m benchmarks.compile_cost " + " ".join(sys.argv[1:] if argv is None else argv),
                   settings=vars(args), rows=rows, machine=common.machine_info())
    out = Path(args.out)
    common.write_json(out / "compile_cost.json", summary)
    write_report(summary, out)
    return summary


if __name__ == "__main__":
    main()

"""Benchmark the cache-attention implementations on Llama-3-8B-shaped verify attention.

Shapes: 32 query heads, 8 KV heads, head_dim 128, T = 8 query rows per sequence (a P-EAGLE
verify block), every sequence at the end of a context of 1k / 8k / 32k tokens, batch 1 / 16 / 64,
bf16 KV and fp8 (float8_e4m3fn, per-token scales) KV; q and the output are bf16.

For each (implementation, context, batch, kv dtype) it reports the median time of one call
(several timed runs after a warm-up, each run a jitted chain of R dependent calls, timed with
``block_until_ready``), the achieved bandwidth over the bytes the op must move (K/V rows up to the
query positions + scales + q + out, identical for every implementation) and that bandwidth as
a fraction of the H200's 4.8 TB/s. Small caches are rotated over R distinct copies so repeated
calls do not measure the 60 MB L2. Each result also carries the max error against "xla".

Writes ``<out>/bench.json`` and ``<out>/bench.md``. Combos that do not fit in GPU memory, or
that fail, are recorded as skipped with the reason; a time budget stops starting new combos.

    python -m benchmarks.gpu_kernels --out results/gpu_kernels          # on a GPU
    python -m benchmarks.gpu_kernels --smoke --out results/tmp/gk        # CPU plumbing check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.kernels import quantize_kv
from peagle_jax.kernels.attention import backend, gpu_compute_capability

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e, vendor datasheet
L2_ROTATE_BYTES = 256 << 20  # rotate caches until this many bytes separate two reads of one


def _bytes_moved(b, t, h, kvh, d, ctx, kv_itemsize, per_token_scales):
    kv = 2 * b * ctx * kvh * d * kv_itemsize
    scales = 2 * b * ctx * kvh * 4 if per_token_scales else 0
    qo = 2 * b * t * h * d * 2
    return kv + scales + qo


def _device_memory_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats() or {}
        return int(stats.get("bytes_limit")) if stats.get("bytes_limit") else None
    except Exception:  # noqa: BLE001
        return None


def _make_inputs(key, b, t, h, kvh, d, ctx, kv_kind, copies):
    """q, positions and `copies` independent (k, v, k_scale, v_scale) caches."""
    kq, kk = jax.random.split(key)
    q = jax.random.normal(kq, (b, t, h, d), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(ctx - t, ctx, dtype=jnp.int32), (b, t))
    caches = []
    for i in range(copies):
        k1, k2 = jax.random.split(jax.random.fold_in(kk, i))
        # Generate in bf16 directly (no f32 temporaries at 32k x 64).
        k = jax.random.normal(k1, (b, kvh, ctx, d), jnp.bfloat16)
        v = jax.random.normal(k2, (b, kvh, ctx, d), jnp.bfloat16)
        if kv_kind == "fp8":
            k, ks = quantize_kv(k, "per_token")
            v, vs = quantize_kv(v, "per_token")
        else:
            ks = vs = None
        caches.append((k, v, ks, vs))
        jax.block_until_ready(caches[-1])
    return q, pos, caches


def _chain(fn):
    """A jitted chain: out_i = fn(out_{i-1}, cache_i); one call times len(caches) kernels."""

    @jax.jit
    def run(q, pos, caches):
        for k, v, ks, vs in caches:
            q = fn(q, k, v, pos, k_scale=ks, v_scale=vs)
        return q

    return run


def _time(run, args, reps: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        jax.block_until_ready(run(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - t0)
    return times


def _impls(args, cc) -> list[str]:
    """The implementations to run; Mosaic GPU needs Hopper (sm 9.0) or newer."""
    impls = [i for i in args.impls.split(",") if i]
    if cc is not None and cc < (9, 0) and "mosaic" in impls:
        impls.remove("mosaic")
    return impls


def _env(args, cc, shapes: tuple[int, int, int, int], mem: int | None) -> dict:
    """The run's environment and fixed settings, recorded in the report (and read back by the combos)."""
    h, kvh, d, t = shapes
    return dict(
        jax=jax.__version__,
        python=platform.python_version(),
        backend=jax.default_backend(),
        device=str(jax.devices()[0].device_kind),
        compute_capability=None if cc is None else f"{cc[0]}.{cc[1]}",
        interpret=cc is None,
        shapes=dict(heads=h, kv_heads=kvh, head_dim=d, t=t),
        peak_bytes_per_s=PEAK_BYTES_PER_S,
        reps=args.reps,
        device_memory_bytes=mem,
    )


def _plan(args, shapes: dict, ctx: int, b: int, kv_kind: str) -> tuple[dict, int, int]:
    """(result-row base, bytes the inputs need, bytes of xla's temporaries) of one combo.

    Caches below half of L2_ROTATE_BYTES are rotated over several copies so that repeated calls
    do not hit L2; larger ones are reused `chain_large` times.
    """
    h, kvh, d, t = shapes["heads"], shapes["kv_heads"], shapes["head_dim"], shapes["t"]
    itemsize = 1 if kv_kind == "fp8" else 2
    nbytes = _bytes_moved(b, t, h, kvh, d, ctx, itemsize, kv_kind == "fp8")
    cache_bytes = 2 * b * ctx * kvh * d * itemsize
    if cache_bytes >= L2_ROTATE_BYTES // 2:
        copies, chain = 1, args.chain_large
    else:
        copies = min(args.max_copies, max(2, math.ceil(L2_ROTATE_BYTES / cache_bytes)))
        chain = copies
    # xla's reference holds f32 copies of K and V plus [B,KVH,G,T,S] f32 scores.
    xla_tmp = 2 * b * ctx * kvh * d * 4 + 3 * b * h * t * ctx * 4
    base = dict(kv=kv_kind, context=ctx, batch=b, bytes=nbytes, copies=copies,
                chain=chain)
    need = copies * (cache_bytes + 2 * b * ctx * kvh * 4) + (4 << 30)
    return base, need, xla_tmp


def _measure(row: dict, fn, impl: str, q, pos, caches, ref_out, reps: int):
    """Fill `row` with `impl`'s error vs xla and its time per call; returns the xla output seen so far.

    A failure is recorded as `skipped` (with the traceback as `error` unless it ran out of memory).
    """
    nbytes, copies, chain = row["bytes"], row["copies"], row["chain"]
    try:
        single = jax.jit(lambda q, pos, k, v, ks, vs, fn=fn: fn(
            q, k, v, pos, k_scale=ks, v_scale=vs))
        out = single(q, pos, *caches[0])
        out = np.asarray(out.astype(jnp.float32))
        if impl == "xla":
            ref_out = out
        elif ref_out is not None:
            row["max_abs_err_vs_xla"] = float(np.max(np.abs(out - ref_out)))
        run = _chain(fn)
        t0 = time.time()
        times = _time(run, (q, pos, caches[:chain] if copies > 1 else caches * chain),
                      reps=reps)
        per_call = statistics.median(times) / chain
        row.update(
            time_us=per_call * 1e6,
            gbps=nbytes / per_call / 1e9,
            frac_peak=nbytes / per_call / PEAK_BYTES_PER_S,
            bench_s=time.time() - t0,
            spread=(max(times) - min(times)) / statistics.median(times),
        )
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        row["skipped"] = msg
        if "RESOURCE_EXHAUSTED" not in msg and "out of memory" not in msg.lower():
            row["error"] = traceback.format_exc()[-2000:]
    return ref_out


def _bench_combo(args, report: dict, impls: list[str], deadline: float, ctx: int, b: int, kv_kind: str) -> None:
    """Every implementation on one (context, batch, kv dtype); rows (or skip reasons) go to the report."""
    env, results = report["env"], report["results"]
    s, mem = env["shapes"], env["device_memory_bytes"]
    base, need, xla_tmp = _plan(args, s, ctx, b, kv_kind)
    if mem is not None and need > 0.9 * mem:
        for impl in impls:
            results.append(dict(base, impl=impl, skipped=f"inputs need {need/2**30:.1f} GiB"))
        return
    if time.time() > deadline:
        for impl in impls:
            results.append(dict(base, impl=impl, skipped="time budget"))
        return
    try:
        q, pos, caches = _make_inputs(
            jax.random.fold_in(jax.random.PRNGKey(0), ctx * 131 + b), b, s["t"], s["heads"], s["kv_heads"],
            s["head_dim"], ctx, kv_kind, base["copies"],
        )
    except Exception as e:  # noqa: BLE001
        for impl in impls:
            results.append(dict(base, impl=impl, skipped=f"alloc: {type(e).__name__}"))
        return
    ref_out = None
    for impl in impls:
        row = dict(base, impl=impl)
        if time.time() > deadline:
            results.append(dict(row, skipped="time budget"))
            continue
        if impl == "xla" and mem is not None and need + xla_tmp > 0.9 * mem:
            results.append(dict(row, skipped="xla temporaries do not fit"))
            continue
        fn = backend(impl, interpret=env["interpret"])
        ref_out = _measure(row, fn, impl, q, pos, caches, ref_out, args.reps)
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "error"}), flush=True)
        write_report(report, args.out)  # partial results survive a timeout kill


def run_bench(args) -> dict:
    cc = gpu_compute_capability()
    impls = _impls(args, cc)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    kv_kinds = [k for k in args.kv.split(",") if k]
    shapes = (8, 2, 64, 8) if args.smoke else (32, 8, 128, 8)  # heads, kv heads, head_dim, T
    mem = _device_memory_bytes()
    deadline = time.time() + args.budget_s
    report = dict(env=_env(args, cc, shapes, mem), results=[])

    # context -> batch -> kv dtype, so a cut by the time budget still covers both dtypes.
    for ctx in contexts:
        for b in batches:
            for kv_kind in kv_kinds:
                _bench_combo(args, report, impls, deadline, ctx, b, kv_kind)
    return report


def write_report(report: dict, out_dir: str) -> str:
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = to_markdown(report)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(md)
    return md


def to_markdown(report: dict) -> str:
    env = report["env"]
    s = env["shapes"]
    lines = [
        "# Cache attention (verify) benchmark",
        "",
        f"{env['device']} (sm {env['compute_capability']}), jax {env['jax']}, "
        f"H={s['heads']} KVH={s['kv_heads']} D={s['head_dim']} T={s['t']}, q/out bf16; "
        f"fp8 = float8_e4m3fn K/V with per-token scales. Time: median per call; GB/s over the "
        f"bytes the op must move (K/V up to the positions, scales, q, out); "
        f"% peak of {env['peak_bytes_per_s'] / 1e12:.1f} TB/s."
        + (" INTERPRET MODE (CPU smoke run): timings meaningless." if env["interpret"] else ""),
        "",
        "| kv | context | batch | impl | time (us) | GB/s | % peak | max err vs xla | note |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        if "time_us" in r:
            err = r.get("max_abs_err_vs_xla")
            lines.append(
                f"| {r['kv']} | {r['context']} | {r['batch']} | {r['impl']} | "
                f"{r['time_us']:.1f} | {r['gbps']:.0f} | {100 * r['frac_peak']:.1f} | "
                f"{'' if err is None else f'{err:.2e}'} | |"
            )
        else:
            lines.append(
                f"| {r['kv']} | {r['context']} | {r['batch']} | {r['impl']} | | | | | "
                f"skipped: {r['skipped'].replace('|', '/')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/gpu_kernels")
    p.add_argument("--impls", default="xla,triton,mosaic")
    p.add_argument("--contexts", default="1024,8192,32768")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--kv", default="bf16,fp8")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chain-large", type=int, default=4)
    p.add_argument("--max-copies", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=180.0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU plumbing check)")
    args = p.parse_args(argv)
    if args.smoke:
        args.contexts, args.batches, args.reps = "64,128", "1,2", 1
        args.max_copies, args.chain_large = 2, 1
    os.makedirs(args.out, exist_ok=True)
    report = run_bench(args)
    md = write_report(report, args.out)
    print(md)
    failed = [r for r in report["results"] if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Synthetic-acceptance benchmark: the speculative loop's throughput at a fixed acceptance length.

  .venv/bin/python -m benchmarks.synthetic --shape llama3-8b [--layers N] [--dtype bfloat16] \
      [--batch-sizes 1 4 16] [--ks 3 5 7] [--target-al 1 2 4] [--prompt-len 128] \
      [--max-new-tokens 256] [--repeats 3] [--out results/synthetic]

  CPU smoke scale:  .venv/bin/python -m benchmarks.synthetic --shape tiny --max-new-tokens 32 --ks 3

SYNTHETIC, and labelled so in every output: the target has RANDOM WEIGHTS in a published shape
(`llama3-8b`: Llama-3-8B; `qwen3-30b-a3b`: Qwen3-30B-A3B MoE; `tiny`/`tiny-moe`: CPU stand-ins;
`--layers` shrinks depth, `--vocab-size` the vocabulary), because no trained head exists for
those models here. Drafts come from `ReferenceDrafter`, an oracle replaying the target's own
greedy continuation (computed first, with method "none", which is also the baseline timing)
and made wrong on a deterministic set of output positions (`wrong_every`). For each requested
acceptance length (AL) and K, the `wrong_every` whose simulated AL is closest is chosen; the
measured AL is reported next to it. The oracle costs no drafter compute, so this measures the
target-side loop (verify K+1 tokens, accept, commit) at a given AL: an upper bound on what a
real head with that AL gives, for the drafter's forward passes are missing.
Prompts are random token ids (fixed seed): acceptance is fixed by construction, so their content
does not matter here (it does for real acceptance: use benchmarks/offline.py for that).
Compilation is excluded (one untimed call per shape; all `wrong_every` values share it).
Methods are interleaved per repeat. Outputs are checked to equal the reference continuation.

Replay mode (`--replay NAME`): the seed's comparison. Each method replays a PUBLISHED
per-position acceptance curve (`PUBLISHED_CURVES`, sources in each entry) and runs a real
random-weight head of its kind every round, so drafting cost is in the timing: P-EAGLE a
`--peagle-layers`-layer head (one forward per round), EAGLE-3 an `--eagle3-layers`-layer head
(K forwards per round). Reports tok/s of none / EAGLE-3 / P-EAGLE per K and the ratios of the
best K of each, next to the published ones:

  python -m benchmarks.synthetic --shape qwen3-30b-a3b --layers 12 --dtype bfloat16 \
      --replay humaneval-blog --ks 3 7 --batch-sizes 1 16 --moe gathered --out results/seed_shape

Writes results/synthetic/synthetic.{json,md}, synthetic_throughput.png, synthetic_acceptance.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common


def _solve(f, target: float) -> float:
    """The r in [0, 1] with f(r) = target, f increasing (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def curve_from_als(al3: float, al7: float, n: int = 10) -> list[float]:
    """A per-position curve with acceptance length al3 at K=3 and al7 at K=7.

    Positions 1-3 decay geometrically with the ratio that gives al3; positions 4.. continue
    from position 3 with the ratio that adds al7 - al3 over positions 4-7.
    """
    r = _solve(lambda x: x + x ** 2 + x ** 3, al3 - 1)
    head = [r, r ** 2, r ** 3]
    q = _solve(lambda x: head[2] * (x + x ** 2 + x ** 3 + x ** 4), al7 - al3)
    return [round(v, 4) for v in head + [head[2] * q ** j for j in range(1, n - 2)]]


# Cumulative per-position acceptance (fraction of rounds whose slot i was accepted) to replay.
PUBLISHED_CURVES: dict[str, dict[str, Any]] = {
    "humaneval-blog": dict(
        source=("vLLM/AWS P-EAGLE blog (2026-03-13), GPT-OSS-20B on 1x B200, HumanEval acceptance lengths: "
                "P-EAGLE 3.02 (K=3) / 3.94 (K=7), EAGLE-3 2.65 (K=3) / 3.03 (K=7). Only ALs were published; each "
                "curve reproduces both of its method's ALs (benchmarks.synthetic.curve_from_als)"),
        peagle=curve_from_als(3.02, 3.94), eagle3=curve_from_als(2.65, 3.03),
        published=dict(peagle_over_eagle3=1.55, note="HumanEval c=1 throughput ratio, best K each (P-EAGLE K=7, "
                                                     "EAGLE-3 K=3)")),
    "humaneval-pr32628": dict(
        source="vLLM PR #32628 (closed precursor of parallel drafting), HumanEval K=8 per-position tables",
        peagle=[0.63, 0.38, 0.23, 0.14, 0.09, 0.05, 0.03, 0.02],
        eagle3=[0.71, 0.49, 0.32, 0.21, 0.14, 0.09, 0.05, 0.03],
        published=dict(note="target and GPU of these tables unconfirmed")),
}
SEED_CLAIMS = dict(peagle_over_none=3.97, peagle_over_eagle3=1.69,
                   note="seed README: up to, B200, concurrency 1 (1.69x is SPEED-Bench; HumanEval is 1.55x)")


def banner(shape: str, layers: int, replay: str | None = None) -> str:
    if replay:
        return (f"SYNTHETIC ACCEPTANCE: random-weight {shape}-shaped target ({layers} layers); random-weight heads run "
                f"every round, their drafts replaced by an oracle replaying the published '{replay}' acceptance "
                f"curves. Not a trained-head measurement.")
    return (f"SYNTHETIC ACCEPTANCE: random-weight {shape}-shaped target ({layers} layers); drafts from an oracle "
            f"(ReferenceDrafter) with a fixed error pattern; no drafter compute. Not a trained-head measurement.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", default="tiny", choices=sorted(common.SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    ap.add_argument("--vocab-size", type=int, default=None, help="override the vocabulary size")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    ap.add_argument("--ks", nargs="+", type=int, default=[3, 5, 7])
    ap.add_argument("--target-al", nargs="+", type=float, default=[1.0, 2.0, 4.0],
                    help="acceptance lengths to emulate (values above K+1 are skipped for that K)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="timed calls per configuration (interleaved)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/synthetic")
    rp = ap.add_argument_group("replay mode (published acceptance curves, real head compute)")
    rp.add_argument("--replay", choices=sorted(PUBLISHED_CURVES), default=None)
    rp.add_argument("--peagle-ks", type=int, nargs="+", default=None, help="P-EAGLE's K values (default --ks)")
    rp.add_argument("--eagle3-ks", type=int, nargs="+", default=None, help="EAGLE-3's K values (default --ks)")
    rp.add_argument("--peagle-layers", type=int, default=4, help="P-EAGLE head depth (blog: 4)")
    rp.add_argument("--eagle3-layers", type=int, default=1, help="EAGLE-3 head depth (1, as released)")
    rp.add_argument("--draft-vocab-size", type=int, default=32000, help="heads' draft vocabulary (speculators: 32k)")
    ap.add_argument("--moe", choices=("dense", "gathered", "grouped"), default="dense",
                    help="MoE evaluation: gathered reads only routed experts at small steps (layers.MoE)")
    ap.add_argument("--layer-loop", choices=("unrolled", "scan"), default="unrolled",
                    help="the target's layers unrolled or under one scan (models.layer_stack)")
    ap.add_argument("--attention", default=None, help="cache attention: xla | cpu | triton | mosaic | auto")
    ap.add_argument("--kv-cache-dtype", default=None, help="e.g. float8_e4m3fn")
    ap.add_argument("--fp8-weights", action="store_true", help="FP8 linear weights (experts stay in --dtype)")
    args = ap.parse_args(argv)
    return args


def _configure(module, args, *, target: bool = False) -> None:
    from peagle_jax.models.options import configure_inference, quantize_weights_fp8

    configure_inference(module, attention=args.attention, kv_cache_dtype=args.kv_cache_dtype, moe=args.moe)
    if args.fp8_weights:
        quantize_weights_fp8(module)
    if target:
        configure_inference(module, layer_loop=args.layer_loop)


def _wrong(p: int, every: int) -> bool:
    return every > 0 and (p * 7 + 3) % every == 0


def simulate(wrong_every: int, k: int, budget: int) -> tuple[float, list[float]]:
    """AL and per-position acceptance of ReferenceDrafter's pattern (host-side model of the loop)."""
    out_len, rounds = 1, 0
    acc = np.zeros(k)
    while out_len < budget:
        a = 0
        while a < k and not _wrong(out_len + a, wrong_every):
            a += 1
        acc[:a] += 1
        rounds += 1
        out_len += a + 1
    if rounds == 0:
        return 1.0, [0.0] * k
    return float((rounds + acc.sum()) / rounds), (acc / rounds).tolist()


def pick_wrong_every(target_al: float, k: int, budget: int, search: int = 64) -> tuple[int, float]:
    """The wrong_every (0 = never wrong) whose simulated AL is closest to target_al."""
    best = None
    for w in range(0, search + 1):
        al, _ = simulate(w, k, budget)
        if best is None or abs(al - target_al) < abs(best[1] - target_al) - 1e-9:
            best = (w, al)
    return best


def time_interleaved(plans: list, generate, k_of, reference: list[list[int]], repeats: int) -> dict:
    """Run every plan `repeats` times, rotating the order each repeat (methods interleaved).

    generate(plan) -> GenerationResult; k_of(plan) -> K (0 = plain decoding). Returns, per
    plan, summed tokens / seconds / rounds / accepted-per-position and whether every output
    equalled `reference`.
    """
    acc: dict = {}
    for rep in range(repeats):
        for plan in plans[rep % len(plans):] + plans[: rep % len(plans)]:
            k = k_of(plan)
            t0 = time.perf_counter()
            r = generate(plan)
            dt = time.perf_counter() - t0
            st = acc.setdefault(plan, dict(tokens=0, seconds=0.0, rounds=0, accepted=np.zeros(max(k, 1)),
                                           exact=True))
            st["tokens"] += int(r.lengths.sum())
            st["seconds"] += dt
            st["rounds"] += int(r.rounds.sum())
            if k:
                st["accepted"] += r.accepted_per_position
            st["exact"] &= r.tokens == reference
    return acc


def acceptance_fields(st: dict, k: int) -> dict[str, Any]:
    """Mean acceptance length and per-position acceptance of `time_interleaved` sums."""
    if not k:
        return dict(mean_acceptance_length=1.0)
    return dict(mean_acceptance_length=(st["rounds"] + st["accepted"].sum()) / st["rounds"],
                acceptance_per_position=(st["accepted"] / st["rounds"]).tolist())


def run(args) -> dict[str, Any]:
    import jax
    from flax import nnx

    from peagle_jax.drafters.reference import ReferenceDrafter
    from peagle_jax.generate import speculative_generate
    from peagle_jax.models import create_model

    n_new = args.max_new_tokens
    cfg = common.shape_config(args.shape, layers=args.layers, vocab_size=args.vocab_size, dtype=args.dtype)
    need = args.prompt_len + n_new + 2 * max(args.ks) + 64
    if cfg.max_position_embeddings < need:
        cfg = cfg.replace(max_position_embeddings=need)
    label = banner(args.shape, cfg.num_hidden_layers, args.replay)
    print(f"WARNING: {label}", file=sys.stderr)
    t0 = time.perf_counter()
    target = create_model(cfg, seed=args.seed)
    _configure(target, args, target=True)
    init_s = time.perf_counter() - t0
    if args.replay:
        return run_replay(args, cfg, target, label, init_s)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.state(target, nnx.Param)))
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, Any]] = []
    compile_s = 0.0
    for bsz in args.batch_sizes:
        prompts = rng.integers(1, cfg.vocab_size, size=(bsz, args.prompt_len)).tolist()
        kw = dict(max_new_tokens=n_new, eos_token_ids=[], temperature=0.0, seed=args.seed)
        t0 = time.perf_counter()
        ref = speculative_generate(target, None, prompts, method="none", **kw)  # compile + reference
        compile_s += time.perf_counter() - t0
        table = np.asarray([t + [0] * (n_new - len(t)) for t in ref.tokens], np.int32)
        plans = [("none", 0, None, 1.0, None)]
        for k in args.ks:
            for al in args.target_al:
                if al > k + 1 + 1e-9:
                    continue
                w, sim_al = pick_wrong_every(al, k, n_new)
                plans.append(("oracle", k, w, sim_al, al))
        plans = list(dict.fromkeys(plans))  # several target ALs may map to the same wrong_every
        oracles = {}
        for _, k, w, _, _ in plans[1:]:
            if (k, w) not in oracles:
                oracles[(k, w)] = ReferenceDrafter(table, cfg.vocab_size, wrong_every=w)
        for k in sorted({p[1] for p in plans[1:]}):  # compile once per K (wrong_every is traced)
            t0 = time.perf_counter()
            d = next(v for (kk, _), v in oracles.items() if kk == k)
            speculative_generate(target, d, prompts, method="peagle", num_draft_tokens=k, **kw)
            compile_s += time.perf_counter() - t0
        # time_interleaved calls generate within this iteration; the defaults bind this batch's values.
        def generate(plan, prompts=prompts, kw=kw, oracles=oracles):
            method, k, w = plan[:3]
            if method == "none":
                return speculative_generate(target, None, prompts, method="none", **kw)
            return speculative_generate(target, oracles[(k, w)], prompts, method="peagle", num_draft_tokens=k, **kw)

        acc = time_interleaved(plans, generate, lambda plan: plan[1], ref.tokens, args.repeats)
        base = acc[plans[0]]
        base_tok_s = base["tokens"] / base["seconds"]
        for plan, s in acc.items():
            method, k, w, sim_al, want = plan
            tok_s = s["tokens"] / s["seconds"]
            row = dict(batch_size=bsz, method=method, k=k, wrong_every=w, target_al=want, simulated_al=sim_al,
                       tokens=s["tokens"], seconds=s["seconds"], tok_s=tok_s, speedup_vs_none=tok_s / base_tok_s,
                       identical_to_reference=bool(s["exact"]), **acceptance_fields(s, k))
            if k:
                row["target_forwards_per_token"] = s["rounds"] / s["tokens"]
            rows.append(row)
            print(f"B={bsz} {method:6s} K={k} w={w} AL={row['mean_acceptance_length']:.2f} "
                  f"{tok_s:9.1f} tok/s  x{row['speedup_vs_none']:.2f}  exact={row['identical_to_reference']}")
    return dict(
        benchmark="synthetic", synthetic=True, banner=label, machine=common.machine_info(),
        model=dict(shape=args.shape, config={k: v for k, v in cfg.__dict__.items()}, parameters=n_params,
                   init_seconds=init_s),
        settings=dict(batch_sizes=args.batch_sizes, ks=args.ks, target_al=args.target_al, prompt_len=args.prompt_len,
                      max_new_tokens=n_new, repeats=args.repeats, dtype=args.dtype, greedy=True,
                      drafter="ReferenceDrafter oracle (method peagle code path, no drafter compute)"),
        compile_and_reference_seconds=compile_s, results=rows,
        all_identical=all(r["identical_to_reference"] for r in rows),
    )


def _head(target, args, method: str):
    from peagle_jax.drafters import DrafterConfig, create_drafter

    tc = target.config
    parallel = method == "peagle"
    cfg = DrafterConfig.for_target(tc, num_layers=args.peagle_layers if parallel else args.eagle3_layers,
                                   parallel_drafting=parallel, mask_token_id=tc.vocab_size - 1 if parallel else None,
                                   draft_vocab_size=min(args.draft_vocab_size, tc.vocab_size))
    head = create_drafter(cfg, seed=args.seed + (2 if parallel else 1))
    _configure(head, args)
    return head


def run_replay(args, cfg, target, label: str, init_s: float) -> dict[str, Any]:
    """none / EAGLE-3 / P-EAGLE with published acceptance replayed and real head compute."""
    import jax
    from flax import nnx

    from peagle_jax.drafters.reference import ReferenceDrafter
    from peagle_jax.generate import speculative_generate

    curves = PUBLISHED_CURVES[args.replay]
    n_new = args.max_new_tokens
    heads = {m: _head(target, args, m) for m in ("eagle3", "peagle")}
    count = lambda m: sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.state(m, nnx.Param)))
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, Any]] = []
    compile_s = 0.0
    ks = dict(eagle3=args.eagle3_ks or args.ks, peagle=args.peagle_ks or args.ks)
    kmax = max(ks["eagle3"] + ks["peagle"])
    for bsz in args.batch_sizes:
        prompts = rng.integers(1, cfg.vocab_size - 1, size=(bsz, args.prompt_len)).tolist()
        kw = dict(max_new_tokens=n_new, eos_token_ids=[], temperature=0.0, seed=args.seed)
        t0 = time.perf_counter()
        ref = speculative_generate(target, None, prompts, method="none", **kw)  # compile + reference
        compile_s += time.perf_counter() - t0
        table = np.asarray([t + [0] * (n_new - len(t)) for t in ref.tokens], np.int32)
        oracles = {m: ReferenceDrafter(table, cfg.vocab_size, acceptance=curves[m], max_draft=max(kmax, 8),
                                       head=heads[m]) for m in heads}
        plans = [("none", 0)] + [(m, k) for m in ("eagle3", "peagle") for k in ks[m]]
        for m, k in plans[1:]:  # compile (excluded from timing)
            t0 = time.perf_counter()
            speculative_generate(target, oracles[m], prompts, method=m, num_draft_tokens=k, **kw)
            compile_s += time.perf_counter() - t0
            print(f"compiled B={bsz} {m} K={k} ({time.perf_counter() - t0:.1f} s)", flush=True)
        # time_interleaved calls generate within this iteration; the defaults bind this batch's values.
        def generate(plan, prompts=prompts, kw=kw, oracles=oracles):
            m, k = plan
            if m == "none":
                return speculative_generate(target, None, prompts, method="none", **kw)
            return speculative_generate(target, oracles[m], prompts, method=m, num_draft_tokens=k, **kw)

        acc = time_interleaved(plans, generate, lambda plan: plan[1], ref.tokens, args.repeats)
        base_tok_s = acc[("none", 0)]["tokens"] / acc[("none", 0)]["seconds"]
        for (m, k), st in acc.items():
            tok_s = st["tokens"] / st["seconds"]
            row = dict(batch_size=bsz, method=m, k=k, tokens=st["tokens"], seconds=st["seconds"], tok_s=tok_s,
                       speedup_vs_none=tok_s / base_tok_s, identical_to_reference=bool(st["exact"]),
                       ms_per_round=1e3 * st["seconds"] / max(st["rounds"] / bsz, 1), **acceptance_fields(st, k))
            if k:
                row["replayed_curve"] = curves[m][:k]
            rows.append(row)
            print(f"B={bsz} {m:6s} K={k} AL={row['mean_acceptance_length']:.2f} {tok_s:9.1f} tok/s "
                  f"x{row['speedup_vs_none']:.2f} exact={row['identical_to_reference']}", flush=True)
    best = {}
    for bsz in args.batch_sizes:
        for m in ("eagle3", "peagle"):
            cands = [r for r in rows if r["batch_size"] == bsz and r["method"] == m]
            best[(bsz, m)] = max(cands, key=lambda r: r["tok_s"])
    ratios = [dict(batch_size=bsz, best_peagle_k=best[(bsz, "peagle")]["k"], best_eagle3_k=best[(bsz, "eagle3")]["k"],
                   peagle_over_none=best[(bsz, "peagle")]["speedup_vs_none"],
                   eagle3_over_none=best[(bsz, "eagle3")]["speedup_vs_none"],
                   peagle_over_eagle3=best[(bsz, "peagle")]["tok_s"] / best[(bsz, "eagle3")]["tok_s"])
              for bsz in args.batch_sizes]
    for r in ratios:
        print(f"B={r['batch_size']}: best P-EAGLE (K={r['best_peagle_k']}) x{r['peagle_over_none']:.2f} over none, "
              f"x{r['peagle_over_eagle3']:.2f} over best EAGLE-3 "
              f"(K={r['best_eagle3_k']}, x{r['eagle3_over_none']:.2f})")
    return dict(
        benchmark="synthetic-replay", synthetic=True, banner=label, machine=common.machine_info(),
        model=dict(shape=args.shape, config={k: v for k, v in cfg.__dict__.items()}, parameters=count(target),
                   init_seconds=init_s),
        heads={m: dict(layers=h.config.num_hidden_layers, parameters=count(h),
                       draft_vocab_size=h.config.draft_vocab_size) for m, h in heads.items()},
        settings=dict(batch_sizes=args.batch_sizes, ks=ks, prompt_len=args.prompt_len, max_new_tokens=n_new,
                      repeats=args.repeats, dtype=args.dtype, greedy=True, moe=args.moe, attention=args.attention,
                      kv_cache_dtype=args.kv_cache_dtype, fp8_weights=args.fp8_weights,
                      drafter="real random-weight heads run every round; drafts replaced by an oracle replaying "
                              "the published curve"),
        replay=dict(name=args.replay, **curves), seed_claims=SEED_CLAIMS,
        compile_and_reference_seconds=compile_s, results=rows, best=ratios,
        all_identical=all(r["identical_to_reference"] for r in rows),
    )


def write_replay_report(summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "synthetic.json", summary)
    m, s, rp = summary["model"], summary["settings"], summary["replay"]
    md = ["# Seed-shaped synthetic benchmark: published acceptance replayed, real head compute", "",
          f"> **{summary['banner']}** Heads run every round (random weights); their drafts are replaced by an oracle "
          f"that replays the published per-position acceptance.", "",
          f"Shape {m['shape']}: {m['config']['num_hidden_layers']} layers, hidden {m['config']['hidden_size']}, "
          f"vocab {m['config']['vocab_size']}, {m['parameters'] / 1e9:.2f} B parameters, {s['dtype']}, MoE {s['moe']}, "
          f"attention {s['attention'] or 'default'}, KV cache {s['kv_cache_dtype'] or s['dtype']}, "
          f"FP8 weights {s['fp8_weights']}. Heads: " + ", ".join(
              f"{k} {h['layers']} layer(s), {h['parameters'] / 1e6:.0f} M params" for k, h in summary["heads"].items())
          + f". Prompt {s['prompt_len']} random tokens, {s['max_new_tokens']} new tokens, {s['repeats']} timed "
          f"repeat(s), methods interleaved; compile excluded. Outputs identical to plain decoding: "
          f"**{summary['all_identical']}**.", "",
          f"Replayed curves ({rp['name']}): {rp['source']}.", ""]
    table = [[r["batch_size"], r["method"], r["k"] or "–", r["mean_acceptance_length"], r["tok_s"],
              r["speedup_vs_none"], r["ms_per_round"],
              " / ".join(f"{100 * a:.0f}" for a in r.get("acceptance_per_position", [])) or "–"]
             for r in summary["results"]]
    md.append(common.md_table(["B", "method", "K", "measured AL", "tok/s", "x none", "ms/round",
                               "accept % per position"], table))
    md += ["", "Best K of each method:", ""]
    md.append(common.md_table(["B", "P-EAGLE K", "P-EAGLE x none", "EAGLE-3 K", "EAGLE-3 x none", "P-EAGLE x EAGLE-3"],
                              [[r["batch_size"], r["best_peagle_k"], r["peagle_over_none"], r["best_eagle3_k"],
                                r["eagle3_over_none"], r["peagle_over_eagle3"]] for r in summary["best"]]))
    c = summary["seed_claims"]
    md += ["", f"Seed claims for comparison: {c['peagle_over_none']}x over none, {c['peagle_over_eagle3']}x over "
               f"EAGLE-3 ({c['note']}).", "", "## Machine", "", common.machine_md(summary["machine"]), ""]
    (out / "synthetic.md").write_text("\n".join(md))


def write_report(summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "synthetic.json", summary)
    m = summary["model"]
    s = summary["settings"]
    md = ["# Synthetic-acceptance benchmark", "", f"> **{summary['banner']}**", "",
          f"Shape {m['shape']}: {m['config']['num_hidden_layers']} layers, hidden {m['config']['hidden_size']}, "
          f"vocab {m['config']['vocab_size']}, {m['parameters'] / 1e6:.1f} M parameters, {s['dtype']}. "
          f"Prompt {s['prompt_len']} random tokens, {s['max_new_tokens']} new tokens, {s['repeats']} timed repeat(s); "
          f"compile excluded. Outputs identical to the reference: **{summary['all_identical']}**.", ""]
    table = [[r["batch_size"], r["method"], r["k"] or "–", r["wrong_every"] if r["wrong_every"] is not None else "–",
              r["target_al"], r["mean_acceptance_length"], r["tok_s"], r["speedup_vs_none"],
              " / ".join(f"{100 * a:.0f}" for a in r.get("acceptance_per_position", [])) or "–"]
             for r in summary["results"]]
    md.append(common.md_table(["B", "method", "K", "wrong_every", "target AL", "measured AL", "tok/s", "x none",
                               "accept % per position"], table))
    md += ["", "## Machine", "", common.machine_md(summary["machine"]), ""]
    (out / "synthetic.md").write_text("\n".join(md))

    plt = common.pyplot()
    rows = summary["results"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for bsz in sorted({r["batch_size"] for r in rows}):
        base = next(r for r in rows if r["batch_size"] == bsz and r["method"] == "none")
        ax.axhline(base["tok_s"], linestyle=":", color="gray")
        for k in sorted({r["k"] for r in rows if r["k"]}):
            pts = sorted((r["mean_acceptance_length"], r["tok_s"]) for r in rows
                         if r["batch_size"] == bsz and r["k"] == k)
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", label=f"B={bsz} K={k}")
    ax.set_xlabel("measured acceptance length")
    ax.set_ylabel("output tokens/s (dotted: no speculation)")
    ax.set_title(f"SYNTHETIC: {m['shape']} ({m['config']['num_hidden_layers']} layers), oracle drafter", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    common.save_figure(fig, out / "synthetic_throughput.png")

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    bmin = min(r["batch_size"] for r in rows)
    common.plot_acceptance(
        ax, [r for r in rows if r["batch_size"] == bmin and r.get("acceptance_per_position")],
        lambda r: f"K={r['k']} w={r['wrong_every']} (AL {r['mean_acceptance_length']:.2f})",
        "SYNTHETIC per-position acceptance (oracle pattern)")
    common.save_figure(fig, out / "synthetic_acceptance.png")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    summary = run(args)
    out = Path(args.out)
    (write_replay_report if args.replay else write_report)(summary, out)
    print((out / "synthetic.md").read_text())
    return summary


if __name__ == "__main__":
    main()

"""Synthetic-acceptance benchmark: the speculative loop's throughput at a fixed acceptance length.

  .venv/bin/python benchmarks/synthetic.py --shape llama3-8b [--layers N] [--dtype bfloat16] \
      [--batch-sizes 1 4 16] [--ks 3 5 7] [--target-al 1 2 4] [--prompt-len 128] \
      [--max-new-tokens 256] [--repeats 3] [--out results/synthetic]

  CPU smoke scale:  .venv/bin/python benchmarks/synthetic.py --shape tiny --max-new-tokens 32 --ks 3

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

Writes results/synthetic/synthetic.{json,md}, synthetic_throughput.png, synthetic_acceptance.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks import common


def banner(shape: str, layers: int) -> str:
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
    return ap.parse_args(argv)


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
    label = banner(args.shape, cfg.num_hidden_layers)
    print(f"WARNING: {label}", file=sys.stderr)
    t0 = time.perf_counter()
    target = create_model(cfg, seed=args.seed)
    init_s = time.perf_counter() - t0
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
        acc: dict[tuple, dict[str, Any]] = {}
        for rep in range(args.repeats):
            order = plans[rep % len(plans):] + plans[: rep % len(plans)]
            for plan in order:
                method, k, w, sim_al, want = plan
                t0 = time.perf_counter()
                if method == "none":
                    r = speculative_generate(target, None, prompts, method="none", **kw)
                else:
                    r = speculative_generate(target, oracles[(k, w)], prompts, method="peagle", num_draft_tokens=k, **kw)
                dt = time.perf_counter() - t0
                s = acc.setdefault(plan, dict(tokens=0, seconds=0.0, rounds=0, accepted=np.zeros(max(k, 1)),
                                              exact=True))
                s["tokens"] += int(r.lengths.sum())
                s["seconds"] += dt
                s["rounds"] += int(r.rounds.sum())
                if k:
                    s["accepted"] += r.accepted_per_position
                s["exact"] &= r.tokens == ref.tokens
        base = acc[plans[0]]
        base_tok_s = base["tokens"] / base["seconds"]
        for plan, s in acc.items():
            method, k, w, sim_al, want = plan
            tok_s = s["tokens"] / s["seconds"]
            row = dict(batch_size=bsz, method=method, k=k, wrong_every=w, target_al=want, simulated_al=sim_al,
                       tokens=s["tokens"], seconds=s["seconds"], tok_s=tok_s, speedup_vs_none=tok_s / base_tok_s,
                       identical_to_reference=bool(s["exact"]))
            if k:
                row["mean_acceptance_length"] = (s["rounds"] + s["accepted"].sum()) / s["rounds"]
                row["acceptance_per_position"] = (s["accepted"] / s["rounds"]).tolist()
                row["target_forwards_per_token"] = s["rounds"] / s["tokens"]
            else:
                row["mean_acceptance_length"] = 1.0
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
                xs, ys = zip(*pts)
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
    write_report(summary, out)
    print((out / "synthetic.md").read_text())
    return summary


if __name__ == "__main__":
    main()

"""Cost of one speculative round vs one plain decode step, and the break-even acceptance length.

Speculation pays when  AL x t(decode step) > t(round)  (AL = tokens per target forward). This
script times `spec_round` itself on a prefilled state: one jitted program runs
`--rounds-per-call` rounds back to back, as the decode loop does, and every timed call starts
from the same input state (copied untimed, then donated). For method none and each
(method, K) it reports:
  * ms per round and its cost relative to one decode step (= the break-even AL),
  * the speed-up a round would give at a given AL (`--at-al`, e.g. your measured ones).
It isolates the hardware question ("how expensive is a K+1-row verify here?") from the head
question ("how many drafts are accepted?"). All programs of one batch size are compiled first
and then timed round-robin, so the ratios come from one interleaved run. On a bf16 CPU a
4-row verify costs about 1.1 decode steps and an 8-row one about 1.4 (the matmuls grow
with the rows); on GPU the two are nearly equal, which is where the paper's speed-ups come from.

  .venv/bin/python -m benchmarks.round_cost [--peagle-head DIR --eagle3-head DIR | --random-heads]
      [--ks 3 5 7] [--batch-sizes 1 4] [--context 256] [--context-source text|random] [--repeats 20]
      [--rounds-per-call 8]
      [--at-al 2 3] [--temperature 0.7 --top-p 0.95 [--mixed]]

The committed context is real chat text by default (MT-Bench first turns in the chat template,
each row ending where an assistant turn starts), so sampled rounds see the peaked
distributions serving sees; `--context-source random` uses uniformly random token ids, whose
flat distributions are the worst case for top-p. `--mixed` adds, for each batch size >= 2, the
sampled program with ONE sampled row and the others greedy: its cost against the greedy round
is how much a greedy request slows down when a sampled one shares its batch.

Writes results/round_cost/round_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common
from peagle_jax.options import QUANTIZED_DRAFT_WEIGHTS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default", help="'default' (SmolLM2), a .gguf / HF dir, or 'tiny'")
    ap.add_argument("--peagle-head", default=None)
    ap.add_argument("--eagle3-head", default=None)
    ap.add_argument("--random-heads", action="store_true", help="random-weight heads (costs only; no acceptance)")
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the timed rounds")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds-per-call", type=int, default=8,
                    help="rounds run back to back in each timed program (times are per round)")
    ap.add_argument("--at-al", type=float, nargs="*", default=[2.0, 3.0], help="report speed-ups at these ALs")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--draft-weights", default="auto", choices=("auto", "native", *QUANTIZED_DRAFT_WEIGHTS),
                    help="the heads' matmul weights on the CPU kernel (load's draft_weights)")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: time sampled rounds (rejection sampling)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--context-source", default="text", choices=("text", "random"),
                    help="committed tokens: real chat text (MT-Bench turns) or random ids")
    ap.add_argument("--mixed", action="store_true",
                    help="with --temperature: also time batches of one sampled row and B-1 greedy rows")
    ap.add_argument("--out", default="results/round_cost")
    a = ap.parse_args(argv)
    if (a.context < 2 or a.repeats < 1 or a.rounds_per_call < 1 or any(k < 1 for k in a.ks)
            or any(b < 1 for b in a.batch_sizes)):
        ap.error("--context >= 2, --repeats >= 1, --rounds-per-call >= 1, --ks >= 1 and --batch-sizes >= 1")
    if a.mixed and a.temperature <= 0:
        ap.error("--mixed needs --temperature > 0")
    return a


def _models(args):
    from peagle_jax.api import LoadedModel, load

    if args.target == "tiny":
        llm = LoadedModel.from_target(common.tiny_target(256, layers=2), name="tiny")
    else:
        llm = load(args.target, method="none", dtype=args.dtype)
    target = llm.target
    drafters = {}
    for method, path in (("peagle", args.peagle_head), ("eagle3", args.eagle3_head)):
        if path:
            drafters[method] = llm.load_head(path, draft_weights=args.draft_weights)
        elif args.random_heads:
            drafters[method] = common.random_drafter(target, parallel=method == "peagle", seed=1)
    if not drafters:
        raise SystemExit("give --peagle-head / --eagle3-head, or --random-heads")
    # The tiny target has no real tokenizer; its context is random ids.
    return target, drafters, (None if args.target == "tiny" else llm.tokenizer), llm.options.get("draft_weights")


@functools.cache
def _jitted(target_def, drafter_def, method: str, k: int, capacity: int, out_size: int, greedy: bool, rounds: int):
    import jax
    import jax.numpy as jnp

    from peagle_jax.generate.speculative import merge_models
    from peagle_jax.generate.steps import (
        SpecConfig,
        draft_settings,
        pending_rows,
        prefill,
        spec_round,
        step_jit,
    )

    config = SpecConfig(method, k, greedy, capacity, out_size)

    def init(ts, ds, tokens, lens, max_new, sp, eos, key):
        target, drafter = merge_models(target_def, ts, drafter_def, ds)
        return prefill(target, drafter, tokens, lens, config, max_new=max_new, sp=sp, eos_ids=eos, key=key)

    # `rounds` rounds back to back in one program, as the decode loop runs them: a lone jitted
    # call also pays for launching the program and waking the thread pool (about 2 ms here).
    def some_rounds(ts, ds, state):
        target, drafter = merge_models(target_def, ts, drafter_def, ds)
        return jax.lax.fori_loop(0, rounds, lambda _, s: spec_round(target, drafter, s, config), state)

    def some_drafts(ts, ds, state):
        target, drafter = merge_models(target_def, ts, drafter_def, ds)
        settings = draft_settings(config, state, state.key, target.config.vocab_size)

        def one(_, carry):  # the proposal's cache feeds the next pass, so no pass is hoisted out
            cache, tokens = carry
            proposal = drafter.propose(cache, pending_rows(state), settings)
            return proposal.cache, tokens + proposal.tokens

        return jax.lax.fori_loop(0, rounds, one, (state.drafter_cache, jnp.zeros((state.done.shape[0], k), jnp.int32)))

    # The round donates its state, as the decode loop and the server do: an undonated state
    # makes XLA copy the whole KV cache in every call.
    return (step_jit(init), step_jit(some_rounds, donate_argnames=("state",)),
            (step_jit(some_drafts) if method != "none" else None))


def interleaved_medians(programs: dict[Any, tuple[Any, tuple]], repeats: int) -> dict[Any, float]:
    """{key: median seconds} of each (jitted fn, args), timed round-robin: every pass runs each
    program once, so a machine that slows down or speeds up mid-run shifts them all alike.
    A program's last argument is copied before each call, untimed: a program that donates it
    (the round) then runs on the same input every time."""
    import jax
    import jax.numpy as jnp

    def fresh(args: tuple) -> tuple:
        return jax.block_until_ready((*args[:-1], jax.tree.map(jnp.copy, args[-1])))

    for fn, args in programs.values():
        jax.block_until_ready(fn(*fresh(args)))  # compile (and warm) before any timing
    times: dict[Any, list[float]] = {key: [] for key in programs}
    for _ in range(repeats):
        for key, (fn, args) in programs.items():
            call = fresh(args)
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*call))
            times[key].append(time.perf_counter() - t0)
    return {key: float(np.median(t)) for key, t in times.items()}


def context_tokens(tokenizer, vocab_size: int, batch: int, context: int, source: str = "text") -> np.ndarray:
    """[batch, context] committed token ids. "text": MT-Bench first turns, chat-encoded and
    concatenated; row b is the `context` tokens that end where turn b's assistant reply starts
    (a prompt shorter than `context` is preceded by the turns before it). "random": uniform ids."""
    if source == "random" or tokenizer is None:
        return np.random.default_rng(0).integers(1, vocab_size, (batch, context))
    stream: list[int] = []
    ends = []
    for item in common.load_prompts("mtbench"):
        stream += common.encode_prompt(tokenizer, item)
        ends.append(len(stream))
    ends = [e for e in ends if e >= context]
    if len(ends) < batch:
        raise SystemExit(f"MT-Bench holds {len(ends)} contexts of {context} tokens; lower --context or --batch-sizes")
    return np.stack([np.asarray(stream[e - context:e]) for e in ends[:batch]])


def round_programs(target, drafter, method: str, k: int, batch: int, context: int, temperature: float = 0.0,
                   top_p: float = 1.0, *, tokens: np.ndarray | None = None,
                   sampled_rows: int | None = None, rounds: int = 8) -> dict[str, tuple[Any, tuple]]:
    """{"round": ..., "draft": ...} (fn, args) pairs: one jitted program of `rounds` `spec_round`s
    from `context` committed tokens (`tokens` [batch, context], random ids if None), and one of
    as many draft steps alone (absent for method none); divide their times by `rounds`. Greedy
    unless `temperature` > 0 (then exact rejection sampling with that temperature and top-p, on
    every row or on the first `sampled_rows`, the rest greedy)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from peagle_jax.generate.speculative import cache_capacity
    from peagle_jax.sampling import SamplingParams

    target_def, ts = nnx.split(target)
    drafter_def, ds = nnx.split(drafter) if drafter is not None else (None, None)
    budget = 64 + rounds * (k + 1)  # no sequence finishes within the timed rounds
    capacity = cache_capacity(context, budget, k)
    init, one_round, draft_only = _jitted(target_def, drafter_def, method, k, capacity, budget, temperature == 0.0,
                                          rounds)
    if tokens is None:
        tokens = context_tokens(None, target.config.vocab_size, batch, context, "random")
    tokens = jnp.asarray(tokens, jnp.int32)
    sp = SamplingParams.full(batch, temperature, 0, top_p)
    if sampled_rows is not None:
        sp = sp._replace(temperature=jnp.where(jnp.arange(batch) < sampled_rows, temperature, 0.0))
    state = init(ts, ds, tokens, jnp.full((batch,), context, jnp.int32), jnp.full((batch,), budget, jnp.int32),
                 sp, jnp.asarray([-1], jnp.int32), jax.random.split(jax.random.key(0), batch))
    programs = {"round": (one_round, (ts, ds, state))}
    if draft_only is not None:
        programs["draft"] = (draft_only, (ts, ds, state))
    return programs


def run(args) -> dict[str, Any]:
    """Greedy rounds against the greedy decode step; with --temperature also sampled rounds,
    against the same greedy step (the cost of sampling itself shows in the ratio). All the
    programs of one batch size are timed interleaved (`interleaved_medians`)."""
    target, drafters, tokenizer, draft_weights = _models(args)
    sampled = f"T={args.temperature} top-p={args.top_p}"
    rows = []
    for b in args.batch_sizes:
        modes = [("greedy", 0.0, None)] + ([(sampled, args.temperature, None)] if args.temperature > 0 else [])
        if args.mixed and b > 1:
            modes.append((f"1 row {sampled}, {b - 1} greedy", args.temperature, 1))
        jobs = [job for label, temp, ns in modes
                for job in [(label, temp, ns, "none", None, 0)]
                + [(label, temp, ns, m, d, k) for m, d in drafters.items() for k in args.ks]]
        tokens = context_tokens(tokenizer, target.config.vocab_size, b, args.context, args.context_source)
        programs = {}
        for label, temp, ns, method, drafter, k in jobs:
            for part, prog in round_programs(target, drafter, method, k, b, args.context, temp, args.top_p,
                                             tokens=tokens, sampled_rows=ns, rounds=args.rounds_per_call).items():
                programs[(label, method, k, part)] = prog
        medians = {key: t / args.rounds_per_call for key, t in interleaved_medians(programs, args.repeats).items()}
        base = medians[("greedy", "none", 0, "round")]
        for label, _, _, method, _, k in jobs:
            t, d = medians[(label, method, k, "round")], medians.get((label, method, k, "draft"))
            row = {"batch_size": b, "sampling": label, "method": method, "k": k, "ms_per_round": 1000 * t,
                   "cost_vs_decode": t / base, "ms_draft": None if d is None else 1000 * d}
            if k:
                row["speedup_at_al"] = {str(a): a * base / t for a in args.at_al if a <= k + 1}
            rows.append(row)
            drafted = "" if d is None else f" (draft {1000 * d:.1f} ms)"
            print(f"B={b} {label} {method} K={k}: {1000 * t:.1f} ms/round{drafted} = {t / base:.2f} greedy "
                  "decode steps", flush=True)
    return {"target": args.target, "dtype": args.dtype, "context": args.context,
            "context_source": args.context_source if tokenizer is not None else "random", "repeats": args.repeats,
            "rounds_per_call": args.rounds_per_call,
            "at_al": args.at_al, "heads": {m: (getattr(args, f"{m}_head") or "RANDOM WEIGHTS") for m in drafters},
            "draft_weights": draft_weights,
            "machine": common.machine_info(), "results": rows, "timing": "interleaved round-robin"}


def write_report(summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "round_cost.json", summary)
    al = summary["at_al"]
    table = [[r["batch_size"], r.get("sampling", "greedy"), r["method"], r["k"] or "-",
              common.fmt(r["ms_per_round"], 1), common.fmt(r.get("ms_draft"), 1),
              common.fmt(r["cost_vs_decode"]), *[common.fmt(r.get("speedup_at_al", {}).get(str(a))) for a in al]]
             for r in summary["results"]]
    md = [f"# Round cost vs decode step ({summary['target']}, {summary.get('dtype', 'float32')}, "
          f"context {summary['context']}, {summary.get('context_source', 'random')}, "
          f"head weights {summary.get('draft_weights') or 'native'})", "",
          "cost = ms per round / ms per greedy plain decode step; for greedy rounds it is the acceptance "
          "length at which speculation breaks even.", "",
          common.md_table(["B", "sampling", "method", "K", "ms/round", "ms drafting", "cost (break-even AL)",
                           *[f"x none at AL {a}" for a in al]],
                          table), "", "## Machine", "", common.machine_md(summary["machine"]), ""]
    (out / "round_cost.md").write_text("\n".join(md))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    summary = run(args)
    write_report(summary, Path(args.out))
    print((Path(args.out) / "round_cost.md").read_text())
    return summary


if __name__ == "__main__":
    main()

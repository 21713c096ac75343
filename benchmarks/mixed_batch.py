"""Does a sampled request slow a greedy one down? A greedy request's time per output token
(TPOT) alone, beside a greedy neighbour and beside a sampled neighbour, on a running server.

  # terminal 1
  .venv/bin/python -m peagle_jax.serve --method peagle -k 3 --max-batch-size 2
  # terminal 2
  .venv/bin/python -m benchmarks.mixed_batch --base-url http://127.0.0.1:8000/v1 \
      [--repeats 6] [--max-tokens 96] [--temperature 0.7] [--top-p 0.95] [--dataset mtbench] \
      [--out results/mixed_batch]

Each repeat takes the next prompt for the measured request A (greedy, `--max-tokens`) and runs
three conditions, their order rotating from one repeat to the next:
  * alone: A by itself;
  * greedy neighbour: a long greedy request B starts first, and A is sent once B streams;
  * sampled neighbour: the same, B sampled with `--temperature` / `--top-p` (seeded).
A is greedy, so it emits the same tokens in the same number of rounds in every condition: only
what a round costs differs. B asks for 4x A's tokens and is cancelled once A is done (the
server frees its slot). A condition where B ended before A shared only part of A's life; it is
reported as not shared and left out of the medians.

The server runs every sequence of a batch in one round, greedy rows verified by argmax and
sampled rows by exact rejection sampling; the sampled path's extra cost is shared by the whole
batch. Reports A's median TPOT per condition and the ratio sampled / greedy neighbour, the
slow-down a greedy user sees when a sampled request joins (#14 asks for at most 1.2x).

Writes results/mixed_batch/mixed_batch.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common
from benchmarks.online import Client, check_loopback

CONDITIONS = ("alone", "greedy neighbour", "sampled neighbour")
NEIGHBOUR_PROMPT = "Write a long, detailed story about {topic}. Give every character a name and a past."
TOPICS = ("a lighthouse keeper", "a lost robot", "two rival bakers", "a river town", "a mountain rescue",
          "a library at night", "a ship's cook", "an old clockmaker")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens of the measured greedy request")
    ap.add_argument("--temperature", type=float, default=0.7, help="the sampled neighbour's temperature")
    ap.add_argument("--top-p", type=float, default=0.95, help="the sampled neighbour's top-p")
    ap.add_argument("--dataset", default="mtbench", choices=common.DATASETS, help="prompts of the measured request")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--out", default="results/mixed_batch")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.max_tokens < 2 or not a.temperature > 0 or not 0 < a.top_p <= 1:
        ap.error("--repeats >= 1, --max-tokens >= 2, --temperature > 0 and 0 < --top-p <= 1")
    check_loopback(a.base_url)
    return a


def tpot(result: dict[str, Any]) -> float | None:
    """Seconds per output token after the first, or None for a failed or one-token request."""
    if not result["ok"] or result["ttft"] is None or result["tokens"] < 2:
        return None
    return (result["latency"] - result["ttft"]) / (result["tokens"] - 1)


async def _timed(coro) -> dict[str, Any]:
    result = await coro
    result["t_end"] = time.perf_counter()
    return result


async def run_condition(client: Client, model: str, prompt: str, condition: str, args, repeat: int) -> dict:
    """One measured request A under `condition`; B (if any) is cancelled once A has finished."""
    neighbour = None
    if condition != "alone":
        sampling = ({"temperature": args.temperature, "top_p": args.top_p, "seed": repeat}
                    if condition == "sampled neighbour" else None)
        streaming, stop = asyncio.Event(), asyncio.Event()
        neighbour = asyncio.create_task(_timed(client.chat(
            model, NEIGHBOUR_PROMPT.format(topic=TOPICS[repeat % len(TOPICS)]), 4 * args.max_tokens,
            sampling=sampling, first_token=streaming, stop=stop)))
        started = asyncio.create_task(streaming.wait())
        await asyncio.wait([started, neighbour], return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if neighbour.done() and neighbour.exception() is None and not neighbour.result()["ok"]:
            raise SystemExit(f"the neighbour request failed: {neighbour.result()['error']}")
    a = await _timed(client.chat(model, prompt, args.max_tokens))
    shared = True
    if neighbour is not None:
        shared = not neighbour.done()
        stop.set()  # closes B's stream; the server frees its slot
        b = await neighbour
        shared = shared and b["ok"]
    await asyncio.sleep(0.5)  # let the engine retire the cancelled neighbour
    return {"repeat": repeat, "condition": condition, "ok": a["ok"], "error": a["error"], "tokens": a["tokens"],
            "tpot_ms": None if tpot(a) is None else 1000 * tpot(a), "shared": shared}


async def run_async(args) -> dict[str, Any]:
    prompts = [it["text"] for it in common.load_prompts(args.dataset)]
    client = Client(args.base_url, args.api_key, args.request_timeout, max_conn=4)
    try:
        model, health = await client.info()
        await client.chat(model, prompts[0], 8)  # warm-up, untimed
        rows = []
        for r in range(args.repeats):
            order = CONDITIONS[r % 3:] + CONDITIONS[: r % 3]
            for condition in order:
                row = await run_condition(client, model, prompts[(r + 1) % len(prompts)], condition, args, r)
                rows.append(row)
                print(f"repeat {r} {condition}: {row['tokens']} tokens, TPOT {common.fmt(row['tpot_ms'], 1)} ms"
                      f"{'' if row['shared'] else ' (neighbour ended first: not shared)'}", flush=True)
    finally:
        await client.close()
    medians = {}
    for c in CONDITIONS:
        xs = [r["tpot_ms"] for r in rows if r["condition"] == c and r["shared"] and r["tpot_ms"] is not None]
        medians[c] = float(np.median(xs)) if xs else None
    g, s = medians["greedy neighbour"], medians["sampled neighbour"]
    return {"base_url": args.base_url, "model": model, "server": health, "max_tokens": args.max_tokens,
            "neighbour_sampling": {"temperature": args.temperature, "top_p": args.top_p},
            "dataset": args.dataset, "repeats": args.repeats, "median_tpot_ms": medians,
            "sampled_over_greedy_neighbour": (s / g) if g and s else None,
            "failures": sum(not r["ok"] for r in rows), "not_shared": sum(not r["shared"] for r in rows),
            "rows": rows, "machine": common.machine_info()}


def write_report(run: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "mixed_batch.json", run)
    med = run["median_tpot_ms"]
    alone = med["alone"]
    table = [[c, common.fmt(med[c], 1), common.fmt(med[c] / alone if med[c] and alone else None)] for c in CONDITIONS]
    server = run["server"]
    md = [f"# A greedy request's TPOT beside a sampled one ({run['model']}, "
          f"server method {server.get('method', '?')})", "",
          f"{run['repeats']} repeats, {run['max_tokens']} tokens per measured request, conditions interleaved; "
          f"the sampled neighbour uses temperature {run['neighbour_sampling']['temperature']}, "
          f"top-p {run['neighbour_sampling']['top_p']}.", "",
          common.md_table(["condition", "median TPOT ms", "x alone"], table), "",
          f"sampled / greedy neighbour: **{common.fmt(run['sampled_over_greedy_neighbour'])}x** "
          f"(failures {run['failures']}, not shared {run['not_shared']})", "",
          "## Machine", "", common.machine_md(run["machine"]), ""]
    (out / "mixed_batch.md").write_text("\n".join(md))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    run = asyncio.run(run_async(args))
    write_report(run, Path(args.out))
    print((Path(args.out) / "mixed_batch.md").read_text())
    return run


if __name__ == "__main__":
    main()

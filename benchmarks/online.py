"""Online benchmark: a load generator for a running OpenAI-compatible server (streaming chat).

  # terminal 1: a server, its method fixed at start (here P-EAGLE, K=7)
  .venv/bin/python -m peagle_jax.serve --drafter DIR --method peagle -k 7 --max-batch-size 64
  # terminal 2: the load, labelled with that method
  .venv/bin/python -m benchmarks.online --base-url http://127.0.0.1:8000/v1 --label peagle-K7 \
      [--concurrency 1 2 4 8 16 32 64] [--requests 64] [--time-limit 120] [--max-tokens 256] \
      [--dataset humaneval] [--limit N] [--out results/online]

Repeat with servers started as `--method none`, `--method eagle3 -k 3`, ... and other labels:
each run is merged into results/online/online.json under its label (same label = replaced;
`--fresh` starts a new file), and the Markdown table and plots show every label.

For each concurrency C, C workers send streaming chat requests back to back (prompts cycling
through the chosen prompt set, temperature 0, `max_tokens`), until `--requests` requests were
sent or `--time-limit` seconds passed (requests in flight are awaited). One untimed request
warms the server up first. Per level it reports:
  * output throughput = completion tokens of all requests / wall time of the level;
  * TTFT (time to first token: request sent -> first non-empty content delta), mean/p50/p90/p99;
  * TPOT (time per output token after the first: (latency - TTFT) / (tokens - 1)), mean/p50/p90;
  * latency, request rate, failures.
Completion tokens come from the final `usage` chunk (`stream_options.include_usage`), else from
the number of content deltas. Only loopback URLs are accepted (127.0.0.1, localhost, ::1).

Writes results/online/online.{json,md} and online.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from benchmarks import common

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--label", default=None, help="name of this run (the server's method); default: from /health")
    ap.add_argument("--model", default=None, help="model id to request (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--requests", type=int, default=64, help="requests per concurrency level (at least C)")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per level before no new requests start")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dataset", default="humaneval", choices=common.DATASETS)
    ap.add_argument("--category", default=None, help="MT-Bench category filter")
    ap.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests before the first level")
    ap.add_argument("--fresh", action="store_true", help="overwrite online.json instead of merging labels")
    ap.add_argument("--out", default="results/online")
    return ap.parse_args(argv)


def check_loopback(base_url: str) -> None:
    host = urlparse(base_url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"refusing {base_url!r}: online.py only talks to loopback servers ({sorted(LOOPBACK)})")


class Client:
    def __init__(self, base_url: str, api_key: str | None, timeout: float, max_conn: int):
        import httpx

        self.base = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # trust_env=False: never route loopback traffic through an HTTP(S)_PROXY from the environment.
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0), trust_env=False,
                                      limits=httpx.Limits(max_connections=max_conn + 4,
                                                          max_keepalive_connections=max_conn + 4))

    async def info(self) -> tuple[str, dict[str, Any]]:
        r = await self.http.get(f"{self.base}/models")
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
        health: dict[str, Any] = {}
        root = self.base[: -len("/v1")] if self.base.endswith("/v1") else self.base
        try:
            h = await self.http.get(f"{root}/health")
            if h.status_code == 200:
                health = h.json()
        except Exception:  # noqa: BLE001 - /health is optional (not part of the OpenAI API)
            pass
        return model, health

    async def chat(self, model: str, text: str, max_tokens: int, *, sampling: dict[str, Any] | None = None,
                   first_token: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> dict[str, Any]:
        """One streaming chat request, timed. `sampling`: extra body fields (default temperature
        0); `first_token` is set when the first content delta arrives; once `stop` is set the
        stream is closed at the next line (the server sees a disconnect). Closing it this way,
        rather than cancelling the task, keeps httpx's connection pool usable."""
        body = dict(model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                    temperature=0.0, stream=True, stream_options={"include_usage": True})
        body.update(sampling or {})
        t0 = time.perf_counter()
        ttft = None
        deltas = 0
        usage = None
        finish = None
        error = None
        try:
            async with self.http.stream("POST", f"{self.base}/chat/completions", json=body) as r:
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                else:
                    async for line in r.aiter_lines():
                        if stop is not None and stop.is_set():
                            break
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        ev = json.loads(data)
                        if "error" in ev:
                            error = str(ev["error"])[:200]
                            continue
                        if ev.get("usage"):
                            usage = ev["usage"]
                        for ch in ev.get("choices") or []:
                            if (ch.get("delta") or {}).get("content"):
                                deltas += 1
                                if ttft is None:
                                    ttft = time.perf_counter() - t0
                                    if first_token is not None:
                                        first_token.set()
                            if ch.get("finish_reason"):
                                finish = ch["finish_reason"]
        except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
            error = f"{type(e).__name__}: {e}"[:200]
        latency = time.perf_counter() - t0
        if first_token is not None:
            first_token.set()  # also on failure: nobody waits forever on a request that ended
        tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else deltas
        return dict(ok=error is None, error=error, latency=latency, ttft=ttft, tokens=tokens, deltas=deltas,
                    finish=finish, usage=usage is not None)

    async def close(self) -> None:
        await self.http.aclose()


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def _mean(xs: list[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


async def run_level(client: Client, model: str, prompts: list[str], c: int, n_requests: int, time_limit: float,
                    max_tokens: int, start_index: int) -> dict[str, Any]:
    counter = {"next": 0}
    results: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    deadline = t_start + time_limit

    async def worker():
        while counter["next"] < n_requests and time.perf_counter() < deadline:
            i = counter["next"]
            counter["next"] += 1
            results.append(await client.chat(model, prompts[(start_index + i) % len(prompts)], max_tokens))

    await asyncio.gather(*(worker() for _ in range(c)))
    wall = time.perf_counter() - t_start
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["ttft"] is not None and r["tokens"] > 1]
    lat = [r["latency"] for r in ok]
    return dict(
        concurrency=c, requests=len(results), ok=len(ok), failed=len(results) - len(ok),
        errors=sorted({r["error"] for r in results if r["error"]})[:5], wall_seconds=wall, output_tokens=tokens,
        output_tok_s=tokens / wall if wall > 0 else None, requests_per_s=len(ok) / wall if wall > 0 else None,
        ttft_mean=_mean(ttft), ttft_p50=_pct(ttft, 50), ttft_p90=_pct(ttft, 90), ttft_p99=_pct(ttft, 99),
        tpot_mean=_mean(tpot), tpot_p50=_pct(tpot, 50), tpot_p90=_pct(tpot, 90),
        latency_mean=_mean(lat), latency_p50=_pct(lat, 50),
        tokens_per_request=tokens / len(ok) if ok else None,
        usage_reported=all(r["usage"] for r in ok) if ok else None,
        time_limited=len(results) < n_requests,
    )


async def run_async(args) -> dict[str, Any]:
    check_loopback(args.base_url)
    items = common.load_prompts(args.dataset, category=args.category if args.dataset == "mtbench" else None,
                                limit=args.limit)
    prompts = [it["text"] for it in items]  # chat messages; the server applies its chat template
    client = Client(args.base_url, args.api_key, args.request_timeout, max(args.concurrency))
    try:
        model, health = await client.info()
        model = args.model or model
        label = args.label or str(health.get("method") or "unlabelled")
        for _ in range(args.warmup):
            w = await client.chat(model, prompts[0], min(args.max_tokens, 16))
            if not w["ok"]:
                raise SystemExit(f"warm-up request failed: {w['error']}")
        levels = []
        start = 0
        for c in args.concurrency:
            n = max(args.requests, c)
            lvl = await run_level(client, model, prompts, c, n, args.time_limit, args.max_tokens, start)
            start += lvl["requests"]
            levels.append(lvl)
            print(f"[{label}] C={c:3d}: {lvl['ok']}/{lvl['requests']} ok, {lvl['output_tok_s'] or 0:8.1f} tok/s, "
                  f"TTFT p50 {1000 * (lvl['ttft_p50'] or 0):7.1f} ms, TPOT p50 {1000 * (lvl['tpot_p50'] or 0):6.1f} ms")
    finally:
        await client.close()
    return dict(label=label, base_url=args.base_url, model=model, server_health=health,
                settings=dict(concurrency=args.concurrency, requests=args.requests, time_limit=args.time_limit,
                              max_tokens=args.max_tokens, dataset=args.dataset, category=args.category,
                              limit=args.limit, prompts=len(prompts), temperature=0.0, stream=True),
                machine=common.machine_info(), levels=levels)


def write_report(run: dict[str, Any], out: Path, *, fresh: bool = False) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "online.json"
    doc: dict[str, Any] = {"benchmark": "online", "runs": {}}
    if path.exists() and not fresh:
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError:
            pass
    doc.setdefault("runs", {})[run["label"]] = run
    common.write_json(path, doc)
    md = ["# Online benchmark (OpenAI-compatible streaming chat)", ""]
    table = []
    for label, r in doc["runs"].items():
        s = r["settings"]
        server = r.get("server_health", {}).get("method", "?")
        md.append(f"- **{label}**: {r['base_url']} model {r['model']}, server {server}"
                  f", {s['dataset']} ({s['prompts']} prompts), max_tokens {s['max_tokens']}")
        for lvl in r["levels"]:
            ms = lambda x: None if x is None else 1000 * x  # noqa: E731
            table.append([label, lvl["concurrency"], f"{lvl['ok']}/{lvl['requests']}", lvl["output_tok_s"],
                          lvl["requests_per_s"], ms(lvl["ttft_p50"]), ms(lvl["ttft_p90"]), ms(lvl["tpot_p50"]),
                          ms(lvl["tpot_p90"]), lvl["latency_p50"], lvl["tokens_per_request"]])
    md += ["", common.md_table(["label", "C", "ok", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p90 ms",
                                "TPOT p50 ms", "TPOT p90 ms", "latency p50 s", "tokens/req"], table), ""]
    md += ["## Machine (load generator; the server shares it when on loopback)", "",
           common.machine_md(run["machine"]), ""]
    (out / "online.md").write_text("\n".join(md))

    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for label, r in doc["runs"].items():
        lv = [x for x in r["levels"] if x["ok"]]
        cs = [x["concurrency"] for x in lv]
        axes[0].plot(cs, [x["output_tok_s"] for x in lv], marker="o", label=label)
        axes[1].plot(cs, [1000 * (x["ttft_p50"] or 0) for x in lv], marker="o", label=label)
        axes[2].plot(cs, [1000 * (x["tpot_p50"] or 0) for x in lv], marker="o", label=label)
    for ax, title in zip(axes, ("output tokens/s", "TTFT p50 (ms)", "TPOT p50 (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "online.png", dpi=110)
    plt.close(fig)
    return doc


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    run = asyncio.run(run_async(args))
    out = Path(args.out)
    write_report(run, out, fresh=args.fresh)
    print((out / "online.md").read_text())
    return run


if __name__ == "__main__":
    main()

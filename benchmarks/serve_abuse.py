"""What a hostile request costs the other users of the default server (#49 F1 and F3), as ratios
from one run with the conditions interleaved.

Starts `python -m peagle_jax.serve` (its defaults, or the flags after `--`), waits until warm, then:

- **Stop strings (F1).** A greedy stream's mean gap between chunks while another request with
  the most stop strings allowed (64 strings, 4096 characters) decodes beside it, against the
  same stream beside the same request without stops. Also: 40,000 stop strings get a 400 that
  names `stop`.
- **Huge prompts (F3).** A small chat request's time while three 3.9 MB chat prompts (far past
  the context) are sent at once, against its time alone. Each huge prompt must get a 400.

  .venv/bin/python -m benchmarks.serve_abuse [--port 8124] [--repeats 5] [-- --max-batch-size 8 ...]

Writes results/serve_abuse/serve_abuse.{json,md}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import common
from benchmarks.serve_startup import start, stop

OUT = common.RESULTS / "serve_abuse"
HUGE_BYTES = 3_900_000


def model_id(client: httpx.Client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


def chat(client: httpx.Client, content: str, **extra) -> httpx.Response:
    body = {"model": model_id(client), "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body)


def stream_gaps(client: httpx.Client, content: str, max_tokens: int) -> list[float]:
    """Seconds between the chunks of a greedy chat stream."""
    body = {"model": model_id(client), "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}
    stamps = []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def stop_strings(client: httpx.Client, repeats: int) -> dict[str, Any]:
    """F1: the stream's mean chunk gap beside a request with the most stops, and without."""
    stops = [f"{i:02d}" + "~" * 62 for i in range(64)]  # 64 strings, 4096 characters, never matched
    too_many = chat(client, "hi", stop=["x"] * 40_000)
    gaps: dict[str, list[float]] = {"without stops": [], "with 64 stops": []}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for _ in range(repeats):
            for name, extra in (("without stops", {}), ("with 64 stops", {"stop": stops})):
                other = pool.submit(chat, client, "Write a long story about a lighthouse keeper.", max_tokens=160,
                                    **extra)
                time.sleep(0.2)  # the other request is decoding when the stream starts
                gaps[name].append(statistics.mean(stream_gaps(client, "Explain how a hash map works.", 96)))
                other.result().raise_for_status()
    means = {name: statistics.median(v) for name, v in gaps.items()}
    return dict(status_40000_stops=too_many.status_code, error_names_stop="stop" in too_many.text,
                gap_ms={k: round(1000 * v, 2) for k, v in means.items()},
                ratio=means["with 64 stops"] / means["without stops"])


def huge_prompts(client: httpx.Client, repeats: int) -> dict[str, Any]:
    """F3: a small request's time beside three 3.9 MB prompts, and alone."""
    huge = "lorem " * (HUGE_BYTES // 6)

    def small() -> float:
        t0 = time.perf_counter()
        chat(client, "Say hello in five words.", max_tokens=16).raise_for_status()
        return time.perf_counter() - t0

    alone, beside, statuses = [], [], []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(repeats):
            alone.append(small())
            bigs = [pool.submit(chat, client, huge, max_tokens=16) for _ in range(3)]
            time.sleep(0.05)  # the huge bodies are on their way
            beside.append(small())
            statuses += [f.result().status_code for f in bigs]
    a, b = statistics.median(alone), statistics.median(beside)
    return dict(alone_s=round(a, 3), beside_s=round(b, 3), ratio=b / a, huge_statuses=sorted(set(statuses)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    with tempfile.TemporaryDirectory(prefix="peagle-abuse-") as tmp:
        proc, startup = start(args.port, Path(tmp) / "xla", extra, Path(tmp) / "server.log")
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=600) as client:
                chat(client, "warm up", max_tokens=8).raise_for_status()
                f1, f3 = stop_strings(client, args.repeats), huge_prompts(client, args.repeats)
        finally:
            stop(proc)
    report = dict(machine=common.machine_info(), command="python -m benchmarks.serve_abuse " + " ".join(argv),
                  server_flags=extra, startup=startup, stop_strings=f1, huge_prompts=f3)
    common.write_json(OUT / "serve_abuse.json", report)
    md = [f"# A hostile request's cost to the others\n\n`{report['command']}`\n", common.machine_md(report["machine"]),
          "", common.md_table(["check", "measured", "goal"], [
              ["40,000 stop strings", f"HTTP {f1['status_40000_stops']}, names stop: {f1['error_names_stop']}",
               "400 naming stop"],
              ["greedy stream's chunk gap beside 64 stops / beside no stops",
               f"{f1['ratio']:.3f} ({f1['gap_ms']['with 64 stops']} / {f1['gap_ms']['without stops']} ms)", "<= 1.2"],
              ["small request beside three 3.9 MB prompts / alone",
               f"{f3['ratio']:.3f} ({f3['beside_s']} / {f3['alone_s']} s)", "<= 1.5"],
              ["the 3.9 MB prompts' status", ", ".join(map(str, f3["huge_statuses"])), "400"]])]
    (OUT / "serve_abuse.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(json.dumps({"F1": f1["ratio"], "F3": f3["ratio"]}))
    ok = (f1["status_40000_stops"] == 400 and f1["error_names_stop"] and f1["ratio"] <= 1.2 and f3["ratio"] <= 1.5
          and f3["huge_statuses"] == [400])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

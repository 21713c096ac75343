"""Where the serving engine's time goes under load, without HTTP: closed-loop clients in process.

C clients each submit a chat request (HumanEval or MT-Bench prompts), wait for it to finish and
submit the next, until R requests are done, against `serve.engine.Engine` built through the
same `load` as the server. Every engine phase is timed by wrapping its method (round, prefill,
insert, release, emit, ...), so the report says how much of the wall time each one takes. Next
to it, the same requests decoded offline in batches of C (`speculative_generate`) in the same
process: the gap between the two is what serving costs beyond decoding. HTTP, SSE and the
client's own work are left out on purpose; `benchmarks.online` measures them.

  .venv/bin/python -m benchmarks.engine_load [--method none|peagle|eagle3] [-k 3]
      [--concurrency 4] [--requests 16] [--max-new-tokens 96] [--max-batch-size 4]
      [--dataset humaneval] [--repeats 2]

Writes results/engine_load/engine_load.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import functools
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import common

#: The engine methods timed (each wraps one phase of an engine step), by their path from the
#: engine: its own steps, and those of its step runner and output processor (`serve.engine`).
PHASES = ("_step", "runner.round", "_prefill_step", "runner.prefill_rows", "_insert", "_resize", "_release",
          "output.emit", "_free_cancelled", "_maybe_shrink", "output.finish")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="none", choices=("none", "peagle", "eagle3"))
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-batch-size", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dataset", default="humaneval", choices=("humaneval", "mtbench"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="results/engine_load")
    args = ap.parse_args(argv)
    if not 1 <= args.concurrency <= args.max_batch_size:
        ap.error(f"--concurrency must be in 1..--max-batch-size ({args.max_batch_size}), got {args.concurrency}")
    if args.requests < args.concurrency:
        ap.error(f"--requests ({args.requests}) must be at least --concurrency ({args.concurrency})")
    return args


class PhaseTimer:
    """Wall time and calls per wrapped engine method (the engine thread runs them one at a time)."""

    def __init__(self, engine, names=PHASES):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        for name in names:
            self._wrap(engine, name)

    def _wrap(self, engine, name: str) -> None:
        *path, attr = name.split(".")
        owner = functools.reduce(getattr, path, engine)
        inner = getattr(owner, attr)

        @functools.wraps(inner)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def closed_loop(engine, prompts: list[list[int]], concurrency: int, max_new: int) -> tuple[int, float]:
    """(completion tokens, seconds) for all prompts, `concurrency` requests in flight at a time."""
    from peagle_jax.serve.engine import Failed, Finished, GenRequest

    todo = collections.deque(prompts)
    lock, done = threading.Lock(), threading.Event()
    state = {"left": len(prompts), "tokens": 0, "error": None}

    def submit_next() -> None:
        with lock:
            if not todo:
                return
            ids = todo.popleft()
        engine.submit(GenRequest(ids, max_new, sink, temperature=0.0))

    def sink(ev) -> None:
        if not isinstance(ev, Finished | Failed):
            return
        with lock:
            if isinstance(ev, Failed):
                state["error"] = ev.message
            else:
                state["tokens"] += ev.completion_tokens
            state["left"] -= 1
            last = state["left"] == 0
        if last:
            done.set()
        else:
            submit_next()

    t0 = time.perf_counter()
    for _ in range(concurrency):
        submit_next()
    done.wait()
    if state["error"]:
        raise RuntimeError(f"a request failed: {state['error']}")
    return state["tokens"], time.perf_counter() - t0


def offline(llm, prompts: list[list[int]], batch: int, max_new: int, k: int) -> tuple[int, float]:
    t0, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        res = llm.generate(prompts[i : i + batch], max_new_tokens=max_new, num_draft_tokens=k, temperature=0.0)
        tokens += sum(len(t) for t in res.tokens)
    return tokens, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from peagle_jax.api import load
    from peagle_jax.serve.engine import Engine

    llm = load(method=args.method)
    items = common.load_prompts(args.dataset)[: args.requests]
    prompts = [common.encode_prompt(llm.tokenizer, it) for it in items]
    engine = Engine(llm.target, llm.drafter, llm.tokenizer, llm.eos_ids, method=llm.method,
                    num_draft_tokens=args.num_draft_tokens, max_batch_size=args.max_batch_size,
                    max_model_len=args.max_model_len)
    timer = PhaseTimer(engine)
    t0 = time.perf_counter()
    engine.start()
    startup = time.perf_counter() - t0
    try:
        closed_loop(engine, prompts, args.concurrency, args.max_new_tokens)  # warm: first-call costs
        offline(llm, prompts[: args.concurrency], args.concurrency, args.max_new_tokens, args.num_draft_tokens)
        runs = []
        for rep in range(args.repeats):  # interleaved: offline, then the engine, each repeat
            off_tokens, off_s = offline(llm, prompts, args.concurrency, args.max_new_tokens, args.num_draft_tokens)
            timer.reset()
            tokens, seconds = closed_loop(engine, prompts, args.concurrency, args.max_new_tokens)
            phases = {n: {"ms": 1e3 * s, "calls": timer.calls[n], "share": s / seconds}
                      for n, s in sorted(timer.seconds.items(), key=lambda kv: -kv[1])}
            runs.append({"repeat": rep, "engine_tok_s": tokens / seconds, "engine_s": seconds,
                         "offline_tok_s": off_tokens / off_s, "phases": phases})
            print(f"repeat {rep}: engine {tokens / seconds:.1f} tok/s, offline batch {args.concurrency} "
                  f"{off_tokens / off_s:.1f} tok/s", flush=True)
    finally:
        engine.shutdown()
    report = {"args": vars(args), "machine": common.machine_info(), "startup_s": startup, "runs": runs}
    out = Path(args.out)
    common.write_json(out / "engine_load.json", report)
    (out / "engine_load.md").write_text(render(report))
    print(render(report))
    return report


def render(report: dict[str, Any]) -> str:
    a = report["args"]
    lines = [f"# Engine under load: {a['method']} (K={a['num_draft_tokens']}), {a['concurrency']} clients, "
             f"{a['requests']} {a['dataset']} requests of {a['max_new_tokens']} tokens", "",
             common.machine_md(report["machine"]), ""]
    for run in report["runs"]:
        lines += [f"Repeat {run['repeat']}: engine {run['engine_tok_s']:.1f} tok/s in {run['engine_s']:.2f} s; "
                  f"offline at batch {a['concurrency']}: {run['offline_tok_s']:.1f} tok/s.", ""]
        rows = [(n, f"{p['ms']:.0f}", p["calls"], f"{p['ms'] / max(p['calls'], 1):.2f}", f"{100 * p['share']:.1f}%")
                for n, p in run["phases"].items()]
        lines += [common.md_table(("phase", "ms", "calls", "ms per call", "of wall time"), rows), ""]
    lines.append("Phases nest: `_step` holds `runner.round` and `output.emit`; `_prefill_step` holds "
                 "`runner.prefill_rows` and `_insert`.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

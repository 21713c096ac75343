"""Self-distillation data: the target answers the prompt mix of `train/prompts.py`, resumably.

  python -m peagle_jax.train.generate_data --out ../runs/sd_v3 [--split train|val]
      [--target-tokens 3000000] [--batch 32] [--max-new-tokens 320] [--magpie 3000]
      [--follow-up-share 0.2] [--model default] [--dtype bfloat16]

Stages, each appending to a JSONL file in --out and resuming where a killed run stopped
(a partial last line is dropped):
  1. magpie_{split}.jsonl   user turns the instruct target writes itself: its chat template up
                            to the user turn, sampled (T=1, top-p 0.95), deduplicated, filtered;
  2. answers_{split}.jsonl  greedy answers to the offline prompts and the magpie turns, in a
                            fixed shuffled order, until --target-tokens answer tokens;
  3. the same file          a follow-up turn (`prompts.FOLLOW_UPS`) to a share of them.
Records are {"name", "domain", "turn", "prompt": ids, "response": ids}, the format
`peagle_jax.train.data.read_selfdistill` reads; `manifest_{split}.json` records the mix, the
tokens per domain and the bytes per answer token. Greedy answers are what greedy serving sees;
features are extracted afterwards by `peagle_jax.train.features` (a bf16 prefill, much faster
than the decode that wrote the answers).
"""

from __future__ import annotations

import argparse
import json
import os
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from peagle_jax.train.prompts import FOLLOW_UPS, Prompt, build_prompts

__all__ = ["generate_answers", "magpie_prompts", "main", "user_turn_prefix"]

_WINDOW = 8  # batches sorted together by prompt length (fewer padded tokens, fewer buckets)


def _resume(path: Path) -> list[dict]:
    """The complete records of a JSONL file; a partial last line (a killed run) is cut off."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        path.write_bytes(raw[: raw.rfind(b"\n") + 1])
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _append(path: Path, records: Sequence[dict]) -> None:
    with open(path, "a") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def user_turn_prefix(tokenizer) -> str:
    """The chat template up to where a user message's text starts (system prompt included)."""
    marker = "\x00MAGPIE\x00"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=False)
    return rendered[: rendered.index(marker)]


def magpie_prompts(llm, out: Path, count: int, *, batch: int, seed: int = 0, max_new_tokens: int = 96,
                   log: Callable = print) -> list[Prompt]:
    """`count` user turns the target writes from its own chat template (Magpie), resumable."""
    done = _resume(out)
    seen = {r["text"] for r in done}
    prefix = llm.encode(user_turn_prefix(llm.tokenizer))
    attempt = len(done) // batch
    while len(seen) < count and attempt < 4 * count // batch + 8:
        res = llm.generate([prefix] * batch, temperature=1.0, top_p=0.95, max_new_tokens=max_new_tokens,
                           seed=seed + attempt, method="none")
        attempt += 1
        fresh = []
        for toks, reason in zip(res.tokens, res.finish_reasons, strict=True):
            text = llm.decode(toks).strip()
            if reason == "stop" and 15 <= len(text) <= 400 and text not in seen and "<|" not in text:
                seen.add(text)
                fresh.append({"text": text})
        _append(out, fresh)
        log(f"magpie: {len(seen)}/{count} user turns")
    return [Prompt(f"magpie/{zlib.crc32(r['text'].encode()):08x}", "magpie", r["text"]) for r in _resume(out)][:count]


def _wants_follow_up(name: str, share: float) -> bool:
    return zlib.crc32(f"follow/{name}".encode()) % 1000 < share * 1000


def generate_answers(llm, prompts: Sequence[Prompt], out: Path, *, target_tokens: int, batch: int,
                     max_new_tokens: int, follow_up_share: float = 0.0, log: Callable = print) -> dict:
    """Append greedy answers (first turns, then follow-ups) to `out` until `target_tokens`
    answer tokens; returns the per-domain counts. Resumes from what `out` already holds."""
    records = _resume(out)
    done = {(r["name"], r["turn"]) for r in records}
    tokens = sum(len(r["response"]) for r in records)
    by_name = {p.id: p for p in prompts}
    first = [[{"role": "user", "content": p.text}] for p in prompts]
    jobs = [(p, 1, m) for p, m in zip(prompts, first, strict=True) if (p.id, 1) not in done]
    tokens = _run(llm, jobs, out, tokens, target_tokens, batch, max_new_tokens, log)
    if follow_up_share > 0:
        firsts = [r for r in _resume(out) if r["turn"] == 1 and _wants_follow_up(r["name"], follow_up_share)]
        jobs = []
        for r in firsts:
            if (r["name"], 2) in done or r["name"] not in by_name:
                continue
            ask = FOLLOW_UPS[zlib.crc32(r["name"].encode()) % len(FOLLOW_UPS)]
            messages = [{"role": "user", "content": by_name[r["name"]].text},
                        {"role": "assistant", "content": llm.decode(r["response"])},
                        {"role": "user", "content": ask}]
            jobs.append((by_name[r["name"]], 2, messages))
        tokens = _run(llm, jobs, out, tokens, target_tokens * (1 + follow_up_share), batch, max_new_tokens, log)
    return summarize(_resume(out))


def _run(llm, jobs, out: Path, tokens: int, target_tokens: int | float, batch: int, max_new_tokens: int,
         log: Callable) -> int:
    """Answer `jobs` [(prompt, turn, messages)] in length-sorted batches; returns the token total."""
    for w in range(0, len(jobs), batch * _WINDOW):
        if tokens >= target_tokens:
            break
        window = [(p, turn, llm.encode_chat(m)) for p, turn, m in jobs[w : w + batch * _WINDOW]]
        window = [j for j in window if len(j[2]) + max_new_tokens <= llm.target.config.max_position_embeddings]
        window.sort(key=lambda j: len(j[2]))
        for b in range(0, len(window), batch):
            chunk = window[b : b + batch]
            ids = [j[2] for j in chunk] + [chunk[-1][2]] * (batch - len(chunk))  # one batch shape
            res = llm.generate(ids, method="none", max_new_tokens=max_new_tokens, temperature=0.0)
            recs = [{"name": p.id, "domain": p.domain, "turn": turn, "prompt": pids, "response": r}
                    for (p, turn, pids), r in zip(chunk, res.tokens, strict=False)]
            _append(out, recs)
            tokens += sum(len(r["response"]) for r in recs)
            log(f"answers: {tokens} tokens ({tokens / target_tokens:.1%} of the target)")
            if tokens >= target_tokens:
                break
    return tokens


def summarize(records: Sequence[dict]) -> dict:
    conversations, answer_tokens, prompt_tokens = Counter(), Counter(), Counter()
    for r in records:
        conversations[r["domain"]] += r["turn"] == 1
        answer_tokens[r["domain"]] += len(r["response"])
        prompt_tokens[r["domain"]] += len(r["prompt"])
    return {"conversations": dict(conversations), "answer_tokens": dict(answer_tokens),
            "prompt_tokens": dict(prompt_tokens), "follow_ups": sum(r["turn"] == 2 for r in records),
            "total_answer_tokens": sum(answer_tokens.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m peagle_jax.train.generate_data", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="run directory (outside the repo; reruns resume)")
    ap.add_argument("--split", choices=("train", "val"), default="train")
    ap.add_argument("--target-tokens", type=int, default=3_000_000, help="answer tokens to write (first turns)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--magpie", type=int, default=3000, help="self-written user turns to add (0: none)")
    ap.add_argument("--follow-up-share", type=float, default=0.2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.batch < 1 or a.max_new_tokens < 1 or a.target_tokens < 1 or not 0 <= a.follow_up_share <= 1:
        ap.error("--batch, --max-new-tokens and --target-tokens must be >= 1; --follow-up-share in [0, 1]")
    from peagle_jax.api import load

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = load(a.model, method="none", dtype=a.dtype)
    prompts = build_prompts(a.split, seed=a.seed)
    magpie = a.magpie if a.split == "train" else a.magpie // 20
    if magpie:
        prompts = _interleave(prompts, magpie_prompts(llm, out / f"magpie_{a.split}.jsonl", magpie,
                                                      batch=a.batch, seed=a.seed))
    summary = generate_answers(llm, prompts, out / f"answers_{a.split}.jsonl", target_tokens=a.target_tokens,
                               batch=a.batch, max_new_tokens=a.max_new_tokens, follow_up_share=a.follow_up_share)
    path = out / f"answers_{a.split}.jsonl"
    summary.update(bytes_per_answer_token=path.stat().st_size / max(summary["total_answer_tokens"], 1),
                   mix=dict(Counter(p.domain for p in prompts)), settings=vars(a), model=str(llm.model_path))
    tmp = out / f"manifest_{a.split}.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / f"manifest_{a.split}.json")
    print(json.dumps(summary["answer_tokens"]), summary["total_answer_tokens"])
    return 0


def _interleave(a: list[Prompt], b: list[Prompt]) -> list[Prompt]:
    """b spread evenly through a (so any prefix of the run has the whole mix)."""
    if not b:
        return a
    step = max(1, len(a) // len(b))
    out, j = [], 0
    for i, p in enumerate(a):
        out.append(p)
        if i % step == step - 1 and j < len(b):
            out.append(b[j])
            j += 1
    return out + b[j:]


if __name__ == "__main__":
    raise SystemExit(main())

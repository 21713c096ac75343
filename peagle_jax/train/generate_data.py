"""Self-distillation data: the target answers the prompt mix of `train/prompts.py`, into
committed shards (`train/shards.py`), resumably.

  python -m peagle_jax.train.generate_data --model qwen2.5-coder-1.5b-instruct
      [--out data/selfdistill/<model>] [--split train|val] [--target-tokens 1000000]
      [--batch 16] [--max-new-tokens 320] [--shard-tokens 50000] [--magpie 3000]
      [--follow-up-share 0.2] [--domains math,chat,...] [--commit]
      [load's settings: --dtype, --target-weights, ...]

Stages, each resuming from what the data folder already holds:
  1. magpie_{split}.jsonl  user turns the instruct target writes itself: its chat template up
                           to the user turn, sampled (T=1, top-p 0.95), deduplicated, filtered;
  2. {split}-NNNNN.npz     greedy answers to the offline prompts and the magpie turns, in a
                           fixed shuffled order, until --target-tokens answer tokens; the
                           serving engine's continuous batching keeps --batch rows busy, and a
                           shard is written each --shard-tokens answer tokens;
  3. the same shards       a follow-up turn (`prompts.FOLLOW_UPS`) to a share of them.
`manifest.json` records the mix, the tokens per domain, the settings and the target file's
sha256. With --commit each new shard is committed to git as soon as it is written, so a killed
run costs at most one shard. Greedy answers are what greedy serving sees; features are
recomputed afterwards by `peagle_jax.train.features` (a bf16 prefill, much faster than the
decode that wrote the answers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError

from peagle_jax.options import add_option_flags, options_from_args, settings_error
from peagle_jax.train.prompts import DOMAINS, FOLLOW_UPS, Prompt, build_prompts
from peagle_jax.train.shards import Record, git_commit, read_records, write_manifest, write_shard

__all__ = ["answer_jobs", "generate_answers", "good_user_turn", "magpie_prompts", "main", "user_turn_prefix"]

_MAX_MODEL_LEN = 2048


def _resume_jsonl(path: Path) -> list[dict]:
    """The complete records of a JSONL file; a partial last line (a killed run) is cut off."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        path.write_bytes(raw[: raw.rfind(b"\n") + 1])
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _append_jsonl(path: Path, records: Sequence[dict]) -> None:
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


class _Answerer:
    """Greedy answers through the serving engine: continuous batching keeps `batch` rows busy
    (a finished answer's row takes the next prompt at once), unlike fixed batches that wait
    for their longest answer."""

    def __init__(self, llm, *, batch: int, max_new_tokens: int, max_model_len: int = _MAX_MODEL_LEN):
        from peagle_jax.serve.engine import Engine

        self.max_new_tokens = max_new_tokens
        self.max_model_len = max_model_len = min(max_model_len, llm.target.config.max_position_embeddings)
        self.engine = Engine(llm.target, None, llm.tokenizer, llm.eos_ids, method="none", max_batch_size=batch,
                             max_model_len=max_model_len, max_queue_size=batch)
        self.engine.start(warmup=False)  # compile the shapes the prompts need, when they need them

    def run(self, jobs, on_done: Callable[[Record, str], bool], *, temperature: float = 0.0, top_p: float = 1.0,
            seed: int = 0, max_new_tokens: int | None = None) -> None:
        """Answer jobs [(prompt, turn, ids)] in order until they run out or `on_done(record,
        finish reason)` returns True (enough tokens). Sampled jobs (temperature > 0) take the
        seed `seed + their position`, so every attempt is a different draw."""
        from peagle_jax.serve.engine import Failed, Finished, GenRequest, QueueFull

        events: queue.Queue = queue.Queue()
        new_tokens = max_new_tokens or self.max_new_tokens
        pending = (j for j in jobs if len(j[2]) + new_tokens < self.max_model_len)
        position = 0
        in_flight: dict[int, tuple] = {}
        stop = False
        while True:
            while not stop and len(in_flight) < 2 * self.engine.max_batch_size:
                job = next(pending, None)
                if job is None:
                    break
                key = position  # events name their request by its submission order
                req = GenRequest(list(job[2]), new_tokens, sink=lambda ev, key=key: events.put((key, ev)),
                                 temperature=temperature, top_p=top_p, seed=seed + key if temperature > 0 else None)
                try:
                    self.engine.submit(req)
                except QueueFull:
                    pending = itertools.chain([job], pending)
                    break
                position += 1
                in_flight[key] = (job, req)
            if not in_flight:
                return
            key, ev = events.get()
            if isinstance(ev, Failed):
                raise RuntimeError(f"the engine failed a request: {ev.message}")
            if not isinstance(ev, Finished):
                continue
            (prompt, turn, ids), req = in_flight.pop(key)
            stop = on_done(Record(prompt.id, prompt.domain, turn, list(ids), list(req.output_ids)), ev.reason) or stop

    def close(self) -> None:
        self.engine.shutdown()


def good_user_turn(text: str) -> bool:
    """A self-written user turn worth answering: 15-400 characters, English prose (it starts
    with a letter and at most 5% of it is non-ASCII: a Qwen target's Magpie turns are often
    Chinese or stray code, and the evaluation prompts are English), no template tokens."""
    if not 15 <= len(text) <= 400 or "<|" in text or not text[0].isalpha():
        return False
    return sum(not c.isascii() for c in text) <= 0.05 * len(text)


def magpie_prompts(llm, out: Path, count: int, *, batch: int, seed: int = 0, max_new_tokens: int = 96,
                   answerer: _Answerer | None = None, log: Callable = print) -> list[Prompt]:
    """`count` user turns the target writes from its own chat template (Magpie), resumable:
    every attempt is appended to `out` (kept or not), so a rerun goes on from the next seed."""
    done = _resume_jsonl(out)
    seen = {r["text"] for r in done if r["kept"] and good_user_turn(r["text"])}
    prefix = llm.encode(user_turn_prefix(llm.tokenizer))
    next_attempt = 1 + max((r.get("attempt", -1) for r in done), default=-1)
    limit = 4 * count + 8 * batch
    if len(seen) < count and next_attempt < limit:
        own = answerer is None
        answerer = answerer or _Answerer(llm, batch=batch, max_new_tokens=max_new_tokens)

        def on_done(rec: Record, finish: str) -> bool:
            text = llm.decode(rec.response).replace("\ufeff", "").strip()
            kept = finish == "stop" and good_user_turn(text) and text not in seen
            if kept:
                seen.add(text)
            _append_jsonl(out, [{"attempt": int(rec.name.split("/")[1]), "text": text, "kept": kept}])
            if len(seen) % 100 == 0 and kept:
                log(f"magpie: {len(seen)}/{count} user turns")
            return len(seen) >= count

        jobs = ((Prompt(f"attempt/{i}", "magpie", ""), 1, prefix) for i in range(next_attempt, limit))
        try:
            answerer.run(jobs, on_done, temperature=1.0, top_p=0.95, seed=seed, max_new_tokens=max_new_tokens)
        finally:
            if own:
                answerer.close()
    kept = [r for r in _resume_jsonl(out) if r["kept"] and good_user_turn(r["text"])][:count]
    return [Prompt(f"magpie/{zlib.crc32(r['text'].encode()):08x}", "magpie", r["text"]) for r in kept]


def _wants_follow_up(name: str, share: float) -> bool:
    return zlib.crc32(f"follow/{name}".encode()) % 1000 < share * 1000


def answer_jobs(llm, prompts: Sequence[Prompt], done: Sequence[Record], follow_up_share: float,
                ) -> tuple[list[tuple[Prompt, int, list[int]]], list[tuple[Prompt, int, list[int]]]]:
    """(first turns, follow-ups) still to answer, as (prompt, turn, prompt ids); follow-ups only
    of first turns already answered. Prompts that leave no room for an answer are left out."""
    answered = {(r.name, r.turn) for r in done}
    by_name = {p.id: p for p in prompts}
    firsts = [(p, 1, llm.encode_chat([{"role": "user", "content": p.text}]))
              for p in prompts if (p.id, 1) not in answered]
    follow = []
    for r in done:
        if r.turn != 1 or (r.name, 2) in answered or r.name not in by_name:
            continue
        if not _wants_follow_up(r.name, follow_up_share):
            continue
        ask = FOLLOW_UPS[zlib.crc32(r.name.encode()) % len(FOLLOW_UPS)]
        messages = [{"role": "user", "content": by_name[r.name].text},
                    {"role": "assistant", "content": llm.decode(r.response)},
                    {"role": "user", "content": ask}]
        follow.append((by_name[r.name], 2, llm.encode_chat(messages)))
    return firsts, follow


def generate_answers(llm, prompts: Sequence[Prompt], folder: Path, *, split: str = "train", target_tokens: int,
                     batch: int, max_new_tokens: int, follow_up_share: float = 0.0, shard_tokens: int = 50_000,
                     on_shard: Callable[[Path], None] = lambda p: None, answerer: _Answerer | None = None,
                     log: Callable = print) -> dict:
    """Answer first turns, then follow-ups, into shards of `folder` until `target_tokens` answer
    tokens of first turns (and their share of follow-ups); resumes from the shards there.
    Returns the per-domain counts of everything written."""
    done = read_records(folder, split)
    vocab = llm.target.config.vocab_size
    buffer: list[Record] = []
    total = sum(len(r.response) for r in done)
    t0, fresh = time.perf_counter(), 0

    def flush() -> None:
        if buffer:
            path = write_shard(folder, split, buffer, vocab)
            done.extend(buffer)
            buffer.clear()
            on_shard(path)

    def on_done(rec: Record, budget: int | float) -> bool:
        nonlocal total, fresh
        buffer.append(rec)
        total += len(rec.response)
        fresh += len(rec.response)
        if sum(len(r.response) for r in buffer) >= shard_tokens:
            flush()
            log(f"answers: {total} tokens ({total / budget:.1%} of {budget:.0f}), "
                f"{fresh / (time.perf_counter() - t0):.1f} answer tokens/s")
        return total >= budget

    own = answerer is None
    answerer = answerer or _Answerer(llm, batch=batch, max_new_tokens=max_new_tokens)
    try:
        firsts, _ = answer_jobs(llm, prompts, done, follow_up_share)
        if total < target_tokens:
            answerer.run(firsts, lambda r, _: on_done(r, target_tokens))
        flush()
        if follow_up_share > 0:
            budget = target_tokens * (1 + follow_up_share)
            _, follow = answer_jobs(llm, prompts, done, follow_up_share)
            if total < budget:
                answerer.run(follow, lambda r, _: on_done(r, budget))
            flush()
    finally:
        if own:
            answerer.close()
    from peagle_jax.train.shards import summarize

    return summarize(done)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m peagle_jax.train.generate_data", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="data folder (default data/selfdistill/<model name>); reruns resume")
    ap.add_argument("--split", choices=("train", "val"), default="train")
    ap.add_argument("--target-tokens", type=int, default=1_000_000, help="answer tokens to write (first turns)")
    ap.add_argument("--batch", type=int, default=16, help="engine rows kept busy (measure the fastest)")
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--shard-tokens", type=int, default=50_000, help="answer tokens per shard")
    ap.add_argument("--magpie", type=int, default=3000, help="self-written user turns to add (0: none)")
    ap.add_argument("--follow-up-share", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--domains", default=",".join(DOMAINS),
                    help="comma-separated prompt domains to answer (default: all of prompts.DOMAINS); a run on "
                         "some of them rebalances a data folder's mix")
    ap.add_argument("--commit", action="store_true", help="git-commit each shard as soon as it is written")
    # the model and how it runs: `load`'s settings (--model, --dtype, --target-weights, ...)
    add_option_flags(ap, skip=("method", "drafter", "num_draft_tokens"))
    a = ap.parse_args(argv)
    if min(a.batch, a.max_new_tokens, a.target_tokens, a.shard_tokens) < 1 or not 0 <= a.follow_up_share <= 1:
        ap.error("--batch, --max-new-tokens, --target-tokens and --shard-tokens must be >= 1; "
                 "--follow-up-share in [0, 1]")
    domains = [d.strip() for d in a.domains.split(",") if d.strip()]
    if not domains or set(domains) - set(DOMAINS):
        ap.error(f"--domains: unknown domain(s) {sorted(set(domains) - set(DOMAINS)) or '(none given)'}; "
                 f"choose from {', '.join(DOMAINS)}")
    from peagle_jax.api import load
    from peagle_jax.checkpoints.known_models import file_sha256
    from peagle_jax.compile_cache import enable_compilation_cache

    enable_compilation_cache()  # a resumed run loads its compiled programs instead of compiling them again
    try:
        options = options_from_args(a).replace(method="none")
    except ValidationError as e:
        ap.error(settings_error(e))
    llm = load(options=options)
    answerer = _Answerer(llm, batch=a.batch, max_new_tokens=a.max_new_tokens)
    folder = Path(a.out) if a.out else Path("data/selfdistill") / llm.model_name
    folder.mkdir(parents=True, exist_ok=True)
    prompts = [p for p in build_prompts(a.split, seed=a.seed) if p.domain in domains]
    magpie = (a.magpie if a.split == "train" else a.magpie // 20) if "magpie" in domains else 0
    if magpie:
        prompts = _interleave(prompts, magpie_prompts(llm, folder / f"magpie_{a.split}.jsonl", magpie,
                                                      batch=a.batch, seed=a.seed, answerer=answerer))
        if a.commit:
            git_commit(folder, f"data: {llm.model_name} magpie user turns ({a.split})")
    weights = llm.options.get("target_weights", "bf16")
    old = _old_manifest(folder)
    header = {"model": llm.model_name, "model_file": llm.model_path.name, "model_sha256": file_sha256(llm.model_path),
              "python": sys.version.split()[0],
              "settings": {k: v for k, v in vars(a).items() if k != "commit" and v is not None},
              # the file's own blocks or bf16 (Options.target_weights): greedy answers can differ at near-ties,
              # so each shard records what wrote it (a resumed run may choose the faster one for its host)
              "target_weights": weights,
              "target_weights_by_shard": _weights_by_shard(old),
              "mix": dict(Counter(p.domain for p in prompts)),
              "command": "python -m peagle_jax.train.generate_data " + " ".join(argv or sys.argv[1:])}
    header["runs"] = _previous_runs(old) + [header["command"]]

    def on_shard(path: Path) -> None:
        header["target_weights_by_shard"][path.name] = weights
        manifest = write_manifest(folder, header)
        if a.commit:
            git_commit(folder, f"data: {llm.model_name} {path.name} "
                        f"({manifest[a.split]['total_answer_tokens']} {a.split} answer tokens)")

    summary = generate_answers(llm, prompts, folder, split=a.split, target_tokens=a.target_tokens, batch=a.batch,
                               max_new_tokens=a.max_new_tokens, follow_up_share=a.follow_up_share,
                               shard_tokens=a.shard_tokens, on_shard=on_shard, answerer=answerer)
    answerer.close()
    write_manifest(folder, header)
    print(json.dumps(summary["answer_tokens"]), summary["total_answer_tokens"])
    return 0


def _old_manifest(folder: Path) -> dict:
    """The manifest an earlier run left in `folder` ({} where there is none)."""
    path = folder / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _weights_by_shard(old: dict) -> dict[str, str]:
    """{shard file: the target weights that wrote it} from an earlier run's manifest (shards
    written before this was recorded take the run's single `target_weights`)."""
    known = dict(old.get("target_weights_by_shard") or {})
    for split in ("train", "val"):
        for shard in (old.get(split) or {}).get("shards", []):
            known.setdefault(shard["file"], old.get("target_weights", "bf16"))
    return known


def _previous_runs(old: dict) -> list[str]:
    """The commands of the runs that wrote the folder before, from its earlier manifest (one from
    before runs were listed holds only its last command)."""
    if old.get("runs"):
        return list(old["runs"])
    return [old["command"]] if old.get("command") else []


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

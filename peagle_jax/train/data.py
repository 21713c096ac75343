"""Training documents, chat-template loss masks, deterministic splits/shuffles and packing.

A document is a token array plus a loss mask (1 on tokens the drafter should learn to
predict: assistant tokens of a chat, every token of a code file). Sources:

* `code`: the running Python's standard library (`sysconfig.get_paths()["stdlib"]`, no
  site-packages), whole files held out for validation by a hash of their relative path;
* `chat`: JSONL conversations rendered with the target's chat template; loss on assistant
  turns (character spans mapped to tokens through the tokenizer's offsets);
* `selfdistill`: HumanEval-style prompts cut from stdlib functions (signature + docstring),
  answered by the target itself (batched greedy `speculative_generate(method="none")`) in its
  chat template; loss on the target's answer. This is where acceptance comes from.
* `random`: a tiny random target's greedy continuations of random prompts (tests).
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np


@dataclass
class Doc:
    tokens: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L]: 1 where token i is a target to learn
    name: str = ""


# --------------------------------------------------------------------------- splits


def is_validation(name: str, val_percent: float) -> bool:
    """Deterministic hold-out by a hash of the name (whole files / prompts)."""
    return (zlib.crc32(name.encode()) % 10000) < val_percent * 100


#: Share of the Python language reference topics held out of training data; the copy-heavy
#: benchmark (benchmarks/copy_heavy.py) quotes only held-out topics.
TOPIC_VAL_PERCENT = 30.0


def pydoc_topics(split: str) -> list[tuple[str, str]]:
    """(name, text) of the language reference topics shipped with every CPython (`pydoc_data`),
    sorted, in the "train" or "val" split."""
    import pydoc_data.topics

    return [(k, v) for k, v in sorted(pydoc_data.topics.topics.items())
            if is_validation(f"pydoc/{k}", TOPIC_VAL_PERCENT) == (split == "val")]


def first_paragraphs(text: str, max_chars: int) -> str:
    """The leading paragraphs of `text` that fit in `max_chars` (at least the first one, cut)."""
    out = ""
    for para in text.strip().split("\n\n"):
        if out and len(out) + 2 + len(para) > max_chars:
            break
        out = f"{out}\n\n{para}" if out else para
    return out[:max_chars]


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of every stdlib .py file, sorted, without site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for f in sorted(filenames):
            if f.endswith(".py"):
                p = Path(dirpath) / f
                out.append((str(p.relative_to(root)), p))
    out.sort()
    return out


def chunk_doc(doc: Doc, max_len: int) -> list[Doc]:
    """Cut a long document into pieces of at most max_len tokens (each >= 2 tokens)."""
    out = []
    for i, s in enumerate(range(0, len(doc.tokens), max_len)):
        t = doc.tokens[s : s + max_len]
        if len(t) >= 2:
            out.append(Doc(t, doc.loss_mask[s : s + max_len], f"{doc.name}#{i}"))
    return out


# --------------------------------------------------------------------------- tokenization


def encode_text(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)


def chat_tokens(tokenizer, messages: Sequence[dict]) -> Doc:
    """Render with the chat template; loss mask on the assistant turns' content (+ end tokens)."""
    full = tokenizer.apply_chat_template(list(messages), tokenize=False)
    spans = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(list(messages[:i]), tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False)
        if not full.startswith(prefix) or not full.startswith(upto):
            raise ValueError("chat template is not prefix-stable; cannot build a loss mask")
        spans.append((len(prefix), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], np.int32)
    mask = np.zeros(len(ids), np.uint8)
    for t, (s, _) in enumerate(enc["offset_mapping"]):
        if any(a <= s < b for a, b in spans):
            mask[t] = 1
    return Doc(ids, mask)


def is_test_file(rel: str) -> bool:
    """The stdlib's own test suites (test/, */tests/, idle_test/): a different register from library code."""
    parts = rel.split("/")
    return any(p in ("test", "tests", "idle_test") for p in parts[:-1]) or parts[-1].startswith("test_")


def code_docs(tokenizer, *, split: str, val_percent: float, max_docs: int | None, eos_id: int | None,
              tokens_per_file: int | None = None, skip_tests: bool = False) -> list[Doc]:
    """stdlib .py files as documents. `tokens_per_file` keeps one window per file (at an offset
    fixed by the file name's hash) so a token budget spreads over many modules instead of the
    first few files in alphabetical order."""
    docs = []
    for rel, path in stdlib_files():
        if is_validation(rel, val_percent) != (split == "val"):
            continue
        if skip_tests and is_test_file(rel):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        ids = encode_text(tokenizer, text)
        if eos_id is not None:
            ids = np.append(ids, np.int32(eos_id))
        if tokens_per_file and len(ids) > tokens_per_file:
            start = zlib.crc32(rel.encode()) % (len(ids) - tokens_per_file + 1)
            ids = ids[start : start + tokens_per_file]
        docs.append(Doc(ids, np.ones(len(ids), np.uint8), rel))
        if max_docs and len(docs) >= max_docs:
            break
    return docs


def chat_docs(tokenizer, path: str, *, split: str, val_percent: float, max_docs: int | None) -> list[Doc]:
    docs = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            rec = json.loads(line)
            msgs = rec.get("messages") or [
                {"role": "user", "content": rec["prompt"]},
                {"role": "assistant", "content": rec["response"]},
            ]
            name = rec.get("id", f"line{i}")
            if is_validation(str(name), val_percent) != (split == "val"):
                continue
            d = chat_tokens(tokenizer, msgs)
            d.name = str(name)
            docs.append(d)
            if max_docs and len(docs) >= max_docs:
                break
    return docs


# --------------------------------------------------------------------------- self-distillation


def stdlib_modules(split: str, val_percent: float, skip: Callable[[str], bool]) -> Iterator[tuple[str, ast.Module,
                                                                                                 list[str]]]:
    """(relative path, parsed module, source lines) of the stdlib files in a split, sorted, except
    those `skip` names; unreadable or unparsable files are left out."""
    for rel, path in stdlib_files():
        if is_validation(rel, val_percent) != (split == "val") or skip(rel):
            continue
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        yield rel, tree, src.splitlines()


def stdlib_function_prompts(*, split: str, val_percent: float, limit: int | None) -> list[tuple[str, str]]:
    """(name, prompt) pairs: HumanEval-style 'complete this function' from stdlib functions
    with a docstring (signature + docstring, body removed)."""
    out = []
    for rel, tree, lines in stdlib_modules(split, val_percent, lambda r: "/test" in "/" + r or r.startswith("test")):
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node, clean=False)
            if not doc or len(doc) < 20 or not node.body:
                continue
            body0 = node.body[0]
            head = "\n".join(lines[node.lineno - 1 - len(node.decorator_list) : body0.end_lineno])
            if len(head) > 1500:
                continue
            prompt = (
                "Complete the following Python function. Reply with the full function in a code block.\n\n"
                f"```python\n{head}\n```"
            )
            out.append((f"{rel}:{node.name}", prompt))
            if limit and len(out) >= limit:
                return out
    return out


def generate_selfdistill(target, tokenizer, prompts: list[tuple[str, str]], out_path: Path, *,
                         max_new_tokens: int, batch: int, eos_ids: Sequence[int], log=print) -> None:
    """Append target answers to `out_path` (JSONL of prompt/response ids); resumable."""
    from peagle_jax.generate import speculative_generate

    done = 0
    if out_path.exists():
        raw = out_path.read_bytes()
        if raw and not raw.endswith(b"\n"):  # a crash mid-write: drop the partial record
            out_path.write_bytes(raw[: raw.rfind(b"\n") + 1])
        with open(out_path) as fh:
            done = sum(1 for line in fh if line.strip())
    out_path.parent.mkdir(parents=True, exist_ok=True)
    todo = prompts[done:]
    for s in range(0, len(todo), batch):
        chunk = todo[s : s + batch]
        enc = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for _, p in chunk
        ]
        ids = [encode_text(tokenizer, e).tolist() for e in enc]
        while len(ids) < batch:  # keep the batch shape fixed (one compile)
            ids.append(ids[-1])
        res = speculative_generate(target, None, ids, method="none", max_new_tokens=max_new_tokens,
                                   eos_token_ids=list(eos_ids))
        with open(out_path, "a") as fh:
            # ids / res.tokens are padded to `batch`: zip stops at the real prompts of the chunk.
            for (name, _), p, r in zip(chunk, ids, res.tokens, strict=False):
                fh.write(json.dumps({"name": name, "prompt": p, "response": r}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        log(f"selfdistill: {done + s + len(chunk)}/{len(prompts)} answers")


def read_selfdistill(path: Path) -> list[Doc]:
    """Documents (prompt + response, loss on the response) from a {"name", "prompt",
    "response"} JSONL; an unterminated last line (a writer still running) is left out."""
    docs = []
    with open(path) as fh:
        for line in fh:
            if not line.strip() or not line.endswith("\n"):
                continue
            r = json.loads(line)
            p, a = r["prompt"], r["response"]
            toks = np.asarray(p + a, np.int32)
            mask = np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(a), np.uint8)])
            docs.append(Doc(toks, mask, r["name"]))
    return docs


def random_docs(target, *, num: int, prompt_len: int, new_tokens: int, seed: int, batch: int = 16) -> list[Doc]:
    """Greedy continuations of random prompts by a (tiny) target: learnable, target-shaped data."""
    from peagle_jax.generate import speculative_generate

    rng = np.random.default_rng(seed)
    v = target.config.vocab_size
    docs = []
    for s in range(0, num, batch):
        prompts = [rng.integers(1, v - 1, prompt_len).tolist() for _ in range(min(batch, num - s))]
        res = speculative_generate(target, None, prompts, method="none", max_new_tokens=new_tokens)
        for i, (p, r) in enumerate(zip(prompts, res.tokens, strict=True)):
            toks = np.asarray(p + r, np.int32)
            mask = np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(r), np.uint8)])
            docs.append(Doc(toks, mask, f"rand{s + i}"))
    return docs


# --------------------------------------------------------------------------- packing


def shuffled(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


class PackPlan:
    """Deterministic infinite stream of packed rows: per epoch a seeded permutation of the
    documents, each put in the first row (in order of creation) with room for it. A document
    of L tokens yields L - 1 elements; documents must satisfy L - 1 <= seq_len.

    First fit, not the next row only: with the 0.5B's self-written conversations (244 tokens on
    average, up to 513) rows of 512 closed at the first document that did not fit held 77% real
    tokens; first fit fills them to 97.5%, so a step of the same cost reads a quarter more
    data (docs/training.md). `max_docs` caps the documents a row holds (`raw_row`'s room for the
    tokens the shift leaves out, one a document); 1 puts one document in each row."""

    def __init__(self, lengths: Sequence[int], seq_len: int, seed: int, max_docs: int | None = None):
        self.elems = np.asarray(lengths, np.int64) - 1
        if (self.elems > seq_len).any():
            raise ValueError("a document is longer than seq_len + 1 tokens; chunk it first")
        if max_docs is not None and max_docs < 1:
            raise ValueError(f"max_docs must be >= 1, got {max_docs}")
        self.seq_len, self.seed, self.max_docs = seq_len, seed, max_docs
        self._epochs: dict[int, list[list[int]]] = {}
        self._starts = [0]

    def epoch_rows(self, e: int) -> list[list[int]]:
        if e not in self._epochs:
            rows: list[list[int]] = []
            room = np.zeros(0, np.int64)  # free elements of each row
            for i in shuffled(len(self.elems), self.seed, e):
                L = int(self.elems[i])
                if L <= 0:
                    continue
                fits = np.flatnonzero(room >= L)
                if len(fits):
                    r = int(fits[0])
                    rows[r].append(int(i))
                    room[r] -= L
                else:
                    r = len(rows)
                    rows.append([int(i)])
                    room = np.append(room, self.seq_len - L)
                if self.max_docs is not None and len(rows[r]) >= self.max_docs:
                    room[r] = -1  # full: it holds as many documents as a raw row has room for
            self._epochs[e] = rows
        return self._epochs[e]

    def row(self, index: int) -> tuple[int, list[int]]:
        """(epoch, doc ids) of the index-th row of the stream."""
        while len(self._starts) <= 1 or self._starts[-1] <= index:
            e = len(self._starts) - 1
            self._starts.append(self._starts[-1] + len(self.epoch_rows(e)))
        e = int(np.searchsorted(self._starts, index, side="right") - 1)
        return e, self.epoch_rows(e)[index - self._starts[e]]

    def rows_per_epoch(self) -> int:
        return len(self.epoch_rows(0))


def pack_row(seq_len: int, docs: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]],
             aux_dim: int, hid_dim: int, dtype=np.float32):
    """Pack documents (tokens, loss_mask, aux [L,A] | None, final_hidden [L,H] | None) into one
    row of shifted elements: element i = (x_{i+1}, g_i, h_{i+1}, l_{i+1}), per-document
    positions and document ids (-1 = padding)."""
    n = seq_len
    tokens = np.zeros((n,), np.int32)
    pos = np.zeros((n,), np.int32)
    doc = np.full((n,), -1, np.int32)
    lm = np.zeros((n,), np.float32)
    aux = np.zeros((n, aux_dim), dtype) if aux_dim else None
    fh = np.zeros((n, hid_dim), dtype) if hid_dim else None
    o = 0
    for d, (t, m, a, h) in enumerate(docs):
        L = len(t) - 1
        tokens[o : o + L] = t[1:]
        lm[o : o + L] = m[1:]
        pos[o : o + L] = np.arange(L)
        doc[o : o + L] = d
        if aux is not None:
            aux[o : o + L] = a[:L]
            fh[o : o + L] = h[1:]
        o += L
    return tokens, lm, pos, doc, aux, fh


class RawRow(NamedTuple):
    """A packed row's documents as whole token sequences, for a target forward inside the
    training step (`data.features: online`): each document of L tokens yields L - 1 elements
    (`pack_row`) but needs all L tokens in the target's input, so the raw row has room for
    seq_len + max_docs tokens. A document's tokens see only their own document: `start` is
    the raw index of each token's document start (attention skips the rows before it)."""

    tokens: np.ndarray  # [seq_len + max_docs] int32
    positions: np.ndarray  # [seq_len + max_docs] int32, restarting at 0 in each document
    start: np.ndarray  # [seq_len + max_docs] int32
    elem_index: np.ndarray  # [seq_len] int32: the raw index of element i's taps (its hidden: + 1)


def raw_row(seq_len: int, docs: Sequence[np.ndarray], max_docs: int) -> RawRow:
    """The raw layout of the row `pack_row` makes from the same documents, in the same order."""
    if len(docs) > max_docs:
        raise ValueError(f"{len(docs)} documents in one row; the raw row has room for {max_docs}")
    width = seq_len + max_docs
    tokens = np.zeros((width,), np.int32)
    positions = np.zeros((width,), np.int32)
    start = np.arange(width, dtype=np.int32)  # padding sees itself only
    elem_index = np.zeros((seq_len,), np.int32)
    r = e = 0
    for t in docs:
        n_tok = len(t)
        tokens[r : r + n_tok] = t
        positions[r : r + n_tok] = np.arange(n_tok)
        start[r : r + n_tok] = r
        elem_index[e : e + n_tok - 1] = r + np.arange(n_tok - 1)
        r, e = r + n_tok, e + n_tok - 1
    if e > seq_len:
        raise ValueError(f"the documents hold {e} elements, more than seq_len {seq_len}")
    return RawRow(tokens, positions, start, elem_index)

"""The engine's output side: per-request detokenizing, stop strings and the events a request's
`sink` receives (`Delta` while it runs, then exactly one `Finished` or `Failed`), with the
output metrics (tokens, accepted drafts, finish reasons, latencies).

Pure host work: `OutputProcessor` sees token ids and counts, never the device state. It runs
on the engine thread, except `finish` / `fail`, which `Engine.cancel` and `Engine.shutdown`
may also call from theirs: `claim_end` makes sure a request ends once, whoever ends it.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from peagle_jax.serve.detokenize import IncrementalDetokenizer, StopStrings
from peagle_jax.serve.metrics import Metrics
from peagle_jax.serve.requests import GenRequest

__all__ = ["Delta", "Failed", "Finished", "OutputProcessor", "TokenPiece", "end_reason", "round_depths"]

#: (text, depth) of one emitted token: the text its arrival released (held-back characters are
#: released by a later token, so the pieces join to the delta's text) and its draft depth: d >= 1
#: for the round's d-th draft, accepted by the target; 0 for the target's own token (each round
#: ends with one; the prefill gives the first).
TokenPiece = tuple[str, int]


@dataclasses.dataclass
class Delta:
    text: str
    num_tokens: int
    pieces: list[TokenPiece] | None = None  # per token, for requests with `draft_info` only


def round_depths(num_tokens: int, accepted: int) -> list[int]:
    """The draft depth of each token a round emits: its `accepted` drafts (1, 2, ...), then the
    target's own token (0); fewer when the sequence ended inside the round."""
    return [j + 1 if j < accepted else 0 for j in range(num_tokens)]


@dataclasses.dataclass
class Finished:
    reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    text: str = ""  # any last text released at the end (already included in no Delta)
    accepted_tokens: int = 0  # draft tokens the target accepted, over all rounds
    target_forwards: int = 0  # speculative rounds (target forwards) after the prefill


@dataclasses.dataclass
class Failed:
    message: str


def end_reason(r: GenRequest, hit_eos) -> str:
    """Why a request whose sequence is done (or whose stop string hit) ends: "stop" or "length"."""
    return "stop" if (hit_eos or r.stopper.hit) else "length"


class OutputProcessor:
    """Turns the tokens each round gives a request into text events and metrics."""

    def __init__(self, tokenizer, metrics: Metrics):
        self.tokenizer = tokenizer
        self.tokenizer_lock = threading.Lock()
        self.metrics = metrics
        self._end_lock = threading.Lock()

    def decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def first_tokens(self, reqs: list[GenRequest], prompt_tokens: int) -> None:
        """Prefilled requests got their first token now (it is emitted next)."""
        now = time.perf_counter()
        self.metrics.prompt_tokens.inc(prompt_tokens)
        for r in reqs:
            r.first_token_time = now
            self.metrics.ttft.observe(now - r.arrival)

    def emit(self, r: GenRequest, tokens: list[int], depths: list[int] | None = None) -> bool:
        """Feed new tokens through the detokenizer and stop strings; True once a stop string hit.
        depths: each token's draft depth (`round_depths`; None: all 0), reported to requests
        that asked for draft info."""
        if r.detok is None:
            r.detok = IncrementalDetokenizer(self.decode)
            r.stopper = StopStrings(r.stop)
        out = []
        used = 0
        for tok in tokens:
            used += 1
            out.append(r.stopper.add(r.detok.add([tok])))
            if r.stopper.hit:
                break
        r.completion_tokens += used
        r.output_ids.extend(tokens[:used])
        self.metrics.generation_tokens.inc(used)
        text = "".join(out)
        if r.draft_info:  # every token counts (tok/s, acceptance), even one that released no text yet
            r.sink(Delta(text, used, list(zip(out, depths or [0] * used, strict=False))))
        elif text:
            r.sink(Delta(text, used))
        return r.stopper.hit

    def add_round(self, r: GenRequest, tokens: list[int], accepted: int, speculated: bool) -> bool:
        """One speculative round's result for `r`: `accepted` drafts taken, then `tokens` emitted;
        `speculated`: the round could accept drafts for it. True once a stop string hit."""
        self.metrics.rounds.inc()
        r.accepted_tokens += accepted
        r.target_forwards += 1
        if speculated:
            r.spec_rounds += 1
        self.metrics.acceptance_length.observe(accepted + 1)
        for pos in range(accepted):
            self.metrics.accepted.labels(position=str(pos + 1)).inc()
        return self.emit(r, tokens, round_depths(len(tokens), accepted))

    def claim_end(self, r: GenRequest) -> bool:
        """True exactly once per request: whoever ends it (engine thread, a cancel, a drain)."""
        with self._end_lock:
            if r.finished:
                return False
            r.finished = True
            return True

    def finish(self, r: GenRequest, reason: str) -> None:
        if not self.claim_end(r):
            return
        tail = ""
        if r.detok is not None and reason != "abort":
            if not r.stopper.hit:
                tail = r.stopper.add(r.detok.flush())
                reason = "stop" if r.stopper.hit else reason
            tail += r.stopper.flush()
        now = time.perf_counter()
        self.metrics.requests.labels(finish_reason=reason).inc()
        if reason != "abort":
            self.metrics.e2e.observe(now - r.arrival)
            if r.first_token_time is not None and r.completion_tokens > 1:
                self.metrics.tpot.observe((now - r.first_token_time) / (r.completion_tokens - 1))
        r.sink(Finished(reason, len(r.prompt_ids), r.completion_tokens, tail, r.accepted_tokens, r.target_forwards))

    def fail(self, r: GenRequest, message: str) -> None:
        if not self.claim_end(r):
            return
        self.metrics.requests.labels(finish_reason="error").inc()
        r.sink(Failed(message))

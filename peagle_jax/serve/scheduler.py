"""The engine's scheduler: which request runs where and when. Pure host bookkeeping, no device.

It holds the waiting queue, the prefill jobs admitted from it (`PrefillJob`: short prompts
grouped, a long prompt alone, chunk by chunk) and the batch rows (`slots`: the request in each
row of the device state, None for a free row; as many as the current batch bucket). It decides
admission (as many waiting requests as rows are free), grouping (`group`), which rows
prefilled requests take (`place`), when the batch grows to a larger bucket (`rows_for`) and
when it shrinks (`shrink_to`, after `shrink_after` rounds that fit a smaller one), which old
rows a resized batch keeps (`resize_plan`) and whether a round speculates (`speculate`, asking
the adaptive policy if there is one). `check_request` refuses at the door what the batch
arrays cannot hold. The engine holds the lock; nothing here is thread-safe on its own.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import numpy as np

from peagle_jax.generate.speculative import prompt_bucket
from peagle_jax.serve.adaptive import AdaptivePolicy
from peagle_jax.serve.requests import GenRequest

__all__ = ["PrefillJob", "Scheduler", "batch_buckets", "check_prefill_chunk", "check_request", "pow2",
           "prefill_shapes"]

MAX_TEMPERATURE = 100.0  # the HTTP schema's bound (serve.protocol); finite in float32
INT32_MAX = 2**31 - 1


def pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes a round may run at: powers of two below `max_batch_size`, and it."""
    return tuple(sorted({min(2**i, max_batch_size) for i in range(max_batch_size.bit_length() + 1)}))


def check_prefill_chunk(chunk: int, min_prompt_bucket: int) -> None:
    """ValueError unless `chunk` is a prompt bucket (the chunk is also the largest prefill shape)."""
    if chunk < min_prompt_bucket or prompt_bucket(chunk, min_prompt_bucket) != chunk:
        near = prompt_bucket(max(chunk, min_prompt_bucket), min_prompt_bucket)
        raise ValueError(f"prefill_chunk {chunk} must be a prompt bucket: min_prompt_bucket ({min_prompt_bucket}) "
                         f"times 2^i or 1.5 * 2^i, e.g. {near}")


def prefill_shapes(max_prefill_batch: int, chunk: int, min_prompt_bucket: int,
                   max_prompt_len: int | None = None) -> tuple[tuple[int, int], ...]:
    """Every (rows, prompt bucket) the final prefill of a group can run at.

    A group holds up to `max_prefill_batch` prompts, padded to a power of two, and at most
    `chunk` token rows in all; a longer prompt goes alone, chunk by chunk, so its last chunk
    is bucketed like a short prompt. Finite by design: the engine compiles them all up front.
    `max_prompt_len` (the longest prompt the engine takes) drops buckets no prompt can reach.
    """
    longest = chunk if max_prompt_len is None else max(1, min(chunk, max_prompt_len))
    buckets = sorted({prompt_bucket(n, min_prompt_bucket) for n in range(1, longest + 1)})
    rows = sorted({pow2(n) for n in range(1, max_prefill_batch + 1)})
    return tuple((b, t) for b in rows for t in buckets if b == 1 or b * t <= chunk)


def check_request(r: GenRequest, *, max_model_len: int, vocab_size: int, num_draft_tokens: int,
                  method: str) -> None:
    """ValueError naming the first value of `r` the batch arrays cannot hold."""
    if not r.prompt_ids or len(r.prompt_ids) >= max_model_len:
        raise ValueError(f"prompt has {len(r.prompt_ids)} tokens; it must have 1..{max_model_len - 1}")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in r.prompt_ids):
        raise ValueError(f"prompt has token ids outside [0, {vocab_size})")
    room = max_model_len - len(r.prompt_ids)
    if not 1 <= r.max_new_tokens <= room:
        raise ValueError(f"max_new_tokens {r.max_new_tokens} must be in 1..{room}")
    if not (np.isfinite(r.temperature) and 0 <= r.temperature <= MAX_TEMPERATURE):
        raise ValueError(f"temperature {r.temperature} must be finite and in [0, {MAX_TEMPERATURE}]")
    if not -1 <= r.top_k <= INT32_MAX:
        raise ValueError(f"top_k {r.top_k} must be in [-1, {INT32_MAX}]")
    if not 0 < r.top_p <= 1:
        raise ValueError(f"top_p {r.top_p} must be in (0, 1]")
    n = r.num_speculative_tokens
    if n is not None and not 0 <= n <= num_draft_tokens:
        raise ValueError(f"num_speculative_tokens {n} must be in 0..{num_draft_tokens} (this server's "
                         f"method is {method!r} with k={num_draft_tokens})")


@dataclasses.dataclass(eq=False)
class PrefillJob:
    """Admitted requests prefilled together, or one long prompt, one chunk per engine step."""

    reqs: list[GenRequest]
    context: Any = None  # the long prompt's PromptContext once its first chunk ran
    written: int = 0  # prompt positions already in `context`


class Scheduler:
    """The waiting queue, the prefill jobs and the batch rows, and every decision about them."""

    def __init__(self, max_batch_size: int, *, max_queue_size: int, max_prefill_batch: int, prefill_chunk: int,
                 min_prompt_bucket: int, max_model_len: int, shrink_after: int, num_draft_tokens: int = 0):
        self.max_batch_size = max_batch_size
        self.num_draft_tokens = num_draft_tokens
        self.max_queue_size = max_queue_size
        self.buckets = batch_buckets(max_batch_size)
        self.shrink_after = shrink_after  # rounds the live sequences must fit a smaller bucket first
        self.small_rounds = 0
        self.max_prefill_batch = max(1, min(max_prefill_batch, max_batch_size))
        self.min_prompt_bucket = min_prompt_bucket
        check_prefill_chunk(prefill_chunk, min_prompt_bucket)
        self.prefill_chunk = prefill_chunk
        self.prefill_shapes = prefill_shapes(self.max_prefill_batch, prefill_chunk, min_prompt_bucket,
                                             max_model_len - 1)
        self.slots: list[GenRequest | None] = [None]  # one per state row; len = current bucket
        self.waiting: deque[GenRequest] = deque()
        self.prefills: deque[PrefillJob] = deque()  # admitted, not yet in the batch

    # ------------------------------------------------------------------ counts

    def active(self) -> list[GenRequest]:
        return [r for r in self.slots if r is not None]

    def num_active(self) -> int:
        return sum(r is not None for r in self.slots)

    def any_active(self) -> bool:
        return any(r is not None for r in self.slots)

    def any_cancelled(self) -> bool:
        return any(r is not None and r.cancelled for r in self.slots)

    def prefilling_requests(self) -> list[GenRequest]:
        return [r for j in self.prefills for r in j.reqs]

    def in_flight(self) -> list[GenRequest]:
        """Every request not yet ended: waiting, prefilling, in the batch."""
        return list(self.waiting) + self.prefilling_requests() + self.active()

    def num_prefilling(self) -> int:
        return sum(len(j.reqs) for j in self.prefills)

    def num_free_slots(self) -> int:
        return self.max_batch_size - self.num_active() - self.num_prefilling()

    def room(self) -> int:
        """Requests that may still be queued: free slots plus the queue's room."""
        return self.max_queue_size + self.num_free_slots() - len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefills or self.any_active() or self.any_cancelled())

    def stats(self) -> dict[str, int]:
        return {"active": self.num_active(), "prefilling": self.num_prefilling(), "waiting": len(self.waiting),
                "slots": self.max_batch_size, "rows": len(self.slots)}

    # ------------------------------------------------------------------ admission

    def admit(self) -> list[GenRequest]:
        """Move waiting requests, while rows are free, into prefill jobs; returns the cancelled
        ones met on the way (out of the queue, for the caller to end)."""
        admit: list[GenRequest] = []
        cancelled: list[GenRequest] = []
        while self.waiting and len(admit) < self.num_free_slots():
            r = self.waiting.popleft()
            (cancelled if r.cancelled else admit).append(r)
        self.prefills.extend(self.group(admit))
        return cancelled

    def group(self, reqs: list[GenRequest]) -> list[PrefillJob]:
        """Admitted requests -> prefill jobs, in order: short prompts share a job while it stays
        within `max_prefill_batch` prompts and `prefill_chunk` token rows (padding included); a
        prompt longer than the chunk gets a job of its own, run chunk by chunk."""
        jobs: list[PrefillJob] = []
        group: list[GenRequest] = []
        for r in reqs:
            if len(r.prompt_ids) > self.prefill_chunk:
                jobs.append(PrefillJob([r]))
                continue
            trial = group + [r]
            rows = pow2(len(trial)) * prompt_bucket(max(len(q.prompt_ids) for q in trial), self.min_prompt_bucket)
            if group and (len(trial) > self.max_prefill_batch or rows > self.prefill_chunk):
                jobs.append(PrefillJob(group))
                trial = [r]
            group = trial
        if group:
            jobs.append(PrefillJob(group))
        return jobs

    def drop_cancelled_prefills(self) -> list[GenRequest]:
        """Take cancelled requests out of their prefill jobs (a job left empty ends); returns them."""
        gone = [r for job in self.prefills for r in job.reqs if r.cancelled]
        for job in self.prefills:
            job.reqs = [r for r in job.reqs if not r.cancelled]
        self.prefills = deque(j for j in self.prefills if j.reqs)
        return gone

    def drain(self) -> list[GenRequest]:
        """Every request not yet ended (waiting, prefilling, in the batch), all rows emptied."""
        rest = self.in_flight()
        self.waiting.clear()
        self.prefills.clear()
        self.slots = [None] * len(self.slots)
        return rest

    # ------------------------------------------------------------------ rounds

    def draft_cap(self, r: GenRequest) -> int:
        """The drafts `r` may accept per round."""
        return self.num_draft_tokens if r.num_speculative_tokens is None else r.num_speculative_tokens

    def speculate(self, greedy: bool, policy: AdaptivePolicy | None = None) -> tuple[bool, bool]:
        """Whether the next round speculates, and whether the adaptive `policy` made that choice.
        A round speculates when some row may take drafts (else it is plain anyway) and the
        policy, if any, says so."""
        active = self.active()
        speculate = any(self.draft_cap(r) > 0 for r in active)
        # A seeded sampled request's text is reproducible whatever shares its batch only if its
        # rounds are speculative or not independently of the others: rounds it is in always are.
        pinned = any(r.seed is not None and r.temperature > 0 for r in active)
        if not speculate or policy is None or pinned:
            return speculate, False
        expected = [policy.expected_tokens(r.accepted_tokens, r.spec_rounds, self.draft_cap(r)) for r in active]
        return policy.choose(len(self.slots), greedy, expected), True

    # ------------------------------------------------------------------ rows

    def cancelled_rows(self) -> list[int]:
        return [i for i, r in enumerate(self.slots) if r is not None and r.cancelled]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def rows_for(self, n: int) -> int:
        """Batch rows needed once `n` more sequences join (never fewer than now)."""
        return max(len(self.slots), self.bucket(self.num_active() + n))

    def place(self, reqs: list[GenRequest], rows: int) -> np.ndarray:
        """Give `reqs` free batch rows; the row of each of `rows` prefilled rows (padding rows
        get len(slots): out of range, dropped by the insert)."""
        free = [i for i, r in enumerate(self.slots) if r is None]
        slots = np.full((rows,), len(self.slots), np.int32)
        for i, (r, s) in enumerate(zip(reqs, free, strict=False)):
            r.slot = s
            self.slots[s] = r
            slots[i] = s
        return slots

    def free(self, rows: list[int]) -> None:
        for s in rows:
            self.slots[s] = None

    def reset(self) -> None:
        self.slots = [None] * self.buckets[0]

    def resize_plan(self, rows: int) -> list[int] | None:
        """The old rows a batch of `rows` rows keeps, in their new order (the rest of it: empty
        rows), or None when there is nothing to do (same size, or the live rows do not fit).
        Growing keeps every row in place; shrinking compacts the live rows into the first ones,
        padded with free (done) rows; with no live row nothing is kept."""
        live = [i for i, r in enumerate(self.slots) if r is not None]
        if rows == len(self.slots) or len(live) > rows:
            return None
        if not live:
            return []
        if rows > len(self.slots):
            return list(range(len(self.slots)))
        free = [i for i, r in enumerate(self.slots) if r is None]
        return live + free[: rows - len(live)]

    def apply_resize(self, rows: int, order: list[int]) -> None:
        """The rows after a `resize_plan(rows)` move; each request learns its new row."""
        self.slots = [self.slots[i] for i in order] + [None] * (rows - len(order))
        for i, r in enumerate(self.slots):
            if r is not None:
                r.slot = i
        self.small_rounds = 0

    def shrink_to(self) -> int | None:
        """Called once per engine step: the bucket to compact into now, or None. One bucket down
        once the live sequences have fit it for `shrink_after` steps; the smallest when none is left."""
        n = self.num_active()
        if n == 0:
            return self.buckets[0]
        i = self.buckets.index(len(self.slots))
        if i == 0 or n > self.buckets[i - 1]:
            self.small_rounds = 0
            return None
        self.small_rounds += 1
        return self.buckets[i - 1] if self.small_rounds >= self.shrink_after else None

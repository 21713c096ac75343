"""Continuous-batching engine: up to B sequences, one jitted speculative round per step.

The batch state is one `SpecState` with a fixed cache capacity (max_model_len + 2K + 2) and
R rows, R the smallest *batch bucket* (powers of two up to B, and B) that holds the live
sequences: a round computes R rows, not B, so idle capacity costs nothing. Each engine step is:

  1. cancellations / stop-string hits -> rows marked done (jitted `finish_sequences`);
  2. admission: waiting requests, as long as rows are free, become prefill jobs: short prompts
     grouped (at most `max_prefill_batch` of them and `prefill_chunk` token rows), a longer
     prompt alone. Each step runs ONE unit of prefill: a `prefill_chunk`-token chunk of a long
     prompt (jitted `prefill_chunk`, into the job's own `PromptContext`), or a job's final
     prefill (jitted `prefill`, prompt length bucketed by `prompt_bucket`, batch padded to a
     power of two). So a long prompt delays the others' tokens by one chunk per round, never
     by its whole prefill, and prompt length creates no new shapes: `prefill_shapes` lists
     them all and `start` compiles them before the server says it is ready. Prefilled rows
     get free batch rows, the batch growing to a larger bucket first if needed (copied into a
     larger empty state), and are written in (`insert_sequences`: every per-sequence array,
     both KV caches);
  3. one speculative round over the R rows (jitted `spec_round`, one compilation per bucket and
     greedy flag); finished and empty rows are `done` and stay frozen;
  4. once the live sequences have fit a smaller bucket for `shrink_after` rounds (at once when
     none is left), they are compacted into it (`take_sequences`: each sequence keeps its KV,
     pending rows and PRNG key, so its output does not change).

The loop runs in its own thread. Requests carry a `sink` callback that receives `Delta`,
`Finished` and `Failed` events from that thread (the HTTP layer forwards them to asyncio with
`loop.call_soon_threadsafe`). Detokenization and stop strings are handled here, so a stop
string frees its slot at the next round boundary.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from peagle_jax.generate.speculative import cache_capacity, default_num_draft_tokens, merge_models, prompt_bucket
from peagle_jax.generate.steps import (
    SpecConfig,
    SpecState,
    empty_context,
    finish_sequences,
    insert_sequences,
    prefill,
    prefill_chunk,
    spec_round,
    step_jit,
    take_sequences,
)
from peagle_jax.sampling import SamplingParams
from peagle_jax.serve.adaptive import AdaptivePolicy
from peagle_jax.serve.detokenize import IncrementalDetokenizer, StopStrings
from peagle_jax.serve.metrics import Metrics

log = logging.getLogger("peagle_jax.serve")

__all__ = ["Delta", "Engine", "EngineStopped", "Failed", "Finished", "GenRequest", "QueueFull"]


# --------------------------------------------------------------------------- events


@dataclasses.dataclass
class Delta:
    text: str
    num_tokens: int


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


class QueueFull(Exception):
    pass


class EngineStopped(Exception):
    pass


_ids = itertools.count()
_COMPILE_THREADS = max(1, min(4, os.cpu_count() or 1))  # programs the warm-up compiles side by side
_MAX_TEMPERATURE = 100.0  # the HTTP schema's bound (serve.protocol); finite in float32
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(eq=False)
class GenRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sink: Callable[[Any], None]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    num_speculative_tokens: int | None = None  # drafts accepted per round, 0..K; None: the engine's K
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    # engine-side state
    cancelled: bool = False
    slot: int | None = None
    first_token_time: float | None = None
    completion_tokens: int = 0
    output_ids: list[int] = dataclasses.field(default_factory=list)  # the tokens emitted, in order
    accepted_tokens: int = 0
    target_forwards: int = 0
    spec_rounds: int = 0  # speculative rounds in which it could accept drafts
    detok: IncrementalDetokenizer | None = None
    stopper: StopStrings | None = None
    finished: bool = False


# --------------------------------------------------------------------------- jitted steps


@jax.jit
def _keys_from_seeds(seeds):
    return jax.vmap(jax.random.key)(seeds)


class _Programs:
    """The engine's jitted programs (empty prompt context, prompt chunk, final prefill, round),
    bound to its models once.

    With the models' graph definitions as static arguments, every call hashed them and
    flattened the weights' `nnx.State`: about 16 ms per round on 2 CPU cores, a third of a
    round of the default model. Bound here, a call takes the weights as flat lists of arrays
    and one static flag (greedy or sampled round).
    """

    def __init__(self, target, drafter, spec: SpecConfig):
        target_def, target_state = nnx.split(target)
        drafter_def, drafter_state = nnx.split(drafter) if drafter is not None else (None, None)
        self.weights = (jax.tree.leaves(target_state), jax.tree.leaves(drafter_state))
        target_tree, drafter_tree = jax.tree.structure(target_state), jax.tree.structure(drafter_state)

        def models(weights):
            drafter = None if drafter_def is None else jax.tree.unflatten(drafter_tree, weights[1])
            return merge_models(target_def, jax.tree.unflatten(target_tree, weights[0]), drafter_def, drafter)

        def context_fn(weights, batch_size):
            target, drafter = models(weights)
            return empty_context(target, drafter, batch_size, spec)

        def chunk_fn(weights, context, tokens, following, start):
            target, drafter = models(weights)
            return prefill_chunk(target, drafter, context, tokens, following, start, spec)

        def prefill_fn(weights, context, tokens, start, lens, max_new, sp, eos_ids, key, draft_limit, greedy):
            target, drafter = models(weights)
            return prefill(target, drafter, tokens, lens, dataclasses.replace(spec, greedy=greedy), max_new=max_new,
                           sp=sp, eos_ids=eos_ids, key=key, draft_limit=draft_limit, context=context, start=start)

        def round_fn(weights, state, speculate, greedy):
            """One round; also returns what the host needs: the new tokens of each row and stats.
            `speculate` False runs it with every draft limit 0 (a plain round, see SpecConfig)."""
            target, drafter = models(weights)
            prev_len, prev_hist = state.out_len, state.accepted_per_pos
            limit = state.draft_limit
            new = spec_round(target, drafter, state._replace(draft_limit=jnp.where(speculate, limit, 0)),
                             dataclasses.replace(spec, greedy=greedy))
            new = new._replace(draft_limit=limit)
            idx = prev_len[:, None] + jnp.arange(spec.num_draft_tokens + 1)[None, :]
            toks = jnp.take_along_axis(new.output, jnp.minimum(idx, new.output.shape[1] - 1), axis=1)
            accepted = jnp.sum(new.accepted_per_pos - prev_hist, axis=1)
            return new, (toks, new.out_len - prev_len, new.done, new.hit_eos, accepted)

        self.context = step_jit(context_fn, static_argnames=("batch_size",))
        self.chunk = step_jit(chunk_fn, donate_argnames=("context",))
        self.prefill = step_jit(prefill_fn, static_argnames=("greedy",), donate_argnames=("context",))
        self.round = step_jit(round_fn, static_argnames=("greedy",), donate_argnames=("state",))


@functools.partial(jax.jit, donate_argnames=("state",))
def _insert_jit(state, new, slots):
    return insert_sequences(state, new, slots)


@functools.partial(jax.jit, donate_argnames=("state",))
def _finish_jit(state, mask):
    return finish_sequences(state, mask)


@jax.jit  # no donation: the result has another shape, so the old buffers could not be reused
def _take_jit(state, rows):
    return take_sequences(state, rows)


def _pow2(n: int) -> int:
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
    rows = sorted({_pow2(n) for n in range(1, max_prefill_batch + 1)})
    return tuple((b, t) for b in rows for t in buckets if b == 1 or b * t <= chunk)


@dataclasses.dataclass(eq=False)
class _PrefillJob:
    """Admitted requests prefilled together, or one long prompt, one chunk per engine step."""

    reqs: list[GenRequest]
    context: Any = None  # the long prompt's PromptContext once its first chunk ran
    written: int = 0  # prompt positions already in `context`


# --------------------------------------------------------------------------- engine


class Engine:
    """Owns the models, the batch state and the loop thread."""

    def __init__(
        self,
        target,
        drafter,
        tokenizer,
        eos_ids: Sequence[int],
        *,
        method: str = "none",
        num_draft_tokens: int | None = None,
        max_batch_size: int = 8,
        max_model_len: int = 2048,
        max_queue_size: int = 64,
        max_prefill_batch: int = 4,
        min_prompt_bucket: int = 16,
        prefill_chunk: int = 256,
        seed: int = 0,
        metrics: Metrics | None = None,
        shrink_after: int = 8,
        adaptive: bool = False,
    ):
        """adaptive: choose each round between speculating and a plain decode step by measured
        tokens per second (`serve.adaptive`); head methods (eagle3, peagle) only, else ignored.
        num_draft_tokens None: `generate.default_num_draft_tokens()`."""
        if num_draft_tokens is None:
            num_draft_tokens = default_num_draft_tokens()
        k = num_draft_tokens if method != "none" else 0
        head = method in ("eagle3", "peagle")
        # Greedy is chosen per round (all rows greedy or not); the rest is fixed per engine. Head
        # methods also compile a plain round: when no sequence may take drafts (requests that
        # turn speculation off, or the adaptive policy), a round costs one decode step.
        self._spec = SpecConfig(method, k, True, cache_capacity(max_model_len, 0, k), max_model_len, plain_rounds=head)
        self.adaptive = adaptive and head
        self._policy = AdaptivePolicy() if self.adaptive else None
        self._spec.check_drafter(drafter)
        max_ctx = target.config.max_position_embeddings
        if max_model_len > max_ctx:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context ({max_ctx})")
        self.method = method
        self.num_draft_tokens = k
        self.max_batch_size = max_batch_size
        self.buckets = batch_buckets(max_batch_size)
        self.shrink_after = shrink_after  # rounds the live sequences must fit a smaller bucket first
        self._small_rounds = 0
        self.max_model_len = max_model_len
        self.max_queue_size = max_queue_size
        self.max_prefill_batch = max(1, min(max_prefill_batch, max_batch_size))
        self.min_prompt_bucket = min_prompt_bucket
        check_prefill_chunk(prefill_chunk, min_prompt_bucket)
        self.prefill_chunk = prefill_chunk
        self.prefill_shapes = prefill_shapes(self.max_prefill_batch, prefill_chunk, min_prompt_bucket,
                                             max_model_len - 1)
        self.tokenizer = tokenizer
        self.tokenizer_lock = threading.Lock()
        self.metrics = metrics or Metrics(k, max_batch_size)
        self.vocab_size = target.config.vocab_size
        self.target = target  # the served model (its weights are what `_programs` runs)
        self._programs = _Programs(target, drafter if method != "none" else None, self._spec)
        self._eos = jnp.asarray(np.array(list(eos_ids) or [-1], np.int32))
        self._key = jax.random.key(seed)
        self._seed_rng = np.random.default_rng(seed)  # seeds for requests that give none
        self._state: SpecState | None = None
        self._state_shapes: dict[int, Any] = {}  # batch rows -> SpecState shapes
        self._slots: list[GenRequest | None] = [None]  # one per state row; len = current bucket
        self._waiting: deque[GenRequest] = deque()
        self._prefills: deque[_PrefillJob] = deque()  # admitted, not yet in the batch
        self._cv = threading.Condition()
        self._end_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False  # no new requests
        self._abort = False  # cancel everything and exit
        self.started = False

    # ------------------------------------------------------------------ public API

    def start(self, warmup: bool = True) -> None:
        self._state = self._empty_state(self.buckets[0])
        if warmup:
            t0 = time.perf_counter()
            self._warmup()
            log.info("engine compiled and warmed up in %.1fs", time.perf_counter() - t0)
        self._thread = threading.Thread(target=self._run, name="peagle-engine", daemon=True)
        self._thread.start()
        self.started = True

    def submit(self, req: GenRequest) -> None:
        """Queue one request. Raises QueueFull / EngineStopped / ValueError (see `submit_all`)."""
        self.submit_all([req])

    def submit_all(self, reqs: Sequence[GenRequest]) -> None:
        """Queue the requests of one API call, all or none.

        Every request counts against the capacity (free slots + `max_queue_size` waiting), so a
        prompt list or n > 1 cannot slip past the queue cap. A request whose settings the
        engine's arrays cannot hold raises ValueError before anything is queued: bad data is
        refused at the door and never reaches a batch it shares with others.
        """
        for r in reqs:
            self.check_request(r)
        with self._cv:
            if self._stopping or not self.started:
                raise EngineStopped("the server is shutting down")
            room = self.max_queue_size + self.num_free_slots() - len(self._waiting)
            if len(reqs) > room:
                raise QueueFull(f"the server is at capacity: {len(reqs)} sequences asked for, room for {max(room, 0)} "
                                f"({self.max_batch_size} slots, queue of {self.max_queue_size})")
            self._waiting.extend(reqs)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cv.notify()

    def check_request(self, r: GenRequest) -> None:
        """ValueError naming the first value of `r` the batch arrays cannot hold."""
        if not r.prompt_ids or len(r.prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(r.prompt_ids)} tokens; it must have 1..{self.max_model_len - 1}")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in r.prompt_ids):
            raise ValueError(f"prompt has token ids outside [0, {self.vocab_size})")
        room = self.max_model_len - len(r.prompt_ids)
        if not 1 <= r.max_new_tokens <= room:
            raise ValueError(f"max_new_tokens {r.max_new_tokens} must be in 1..{room}")
        if not (np.isfinite(r.temperature) and 0 <= r.temperature <= _MAX_TEMPERATURE):
            raise ValueError(f"temperature {r.temperature} must be finite and in [0, {_MAX_TEMPERATURE}]")
        if not -1 <= r.top_k <= _INT32_MAX:
            raise ValueError(f"top_k {r.top_k} must be in [-1, {_INT32_MAX}]")
        if not 0 < r.top_p <= 1:
            raise ValueError(f"top_p {r.top_p} must be in (0, 1]")
        n = r.num_speculative_tokens
        if n is not None and not 0 <= n <= self.num_draft_tokens:
            raise ValueError(f"num_speculative_tokens {n} must be in 0..{self.num_draft_tokens} (this server's "
                             f"method is {self.method!r} with k={self.num_draft_tokens})")

    def cancel(self, req: GenRequest) -> None:
        """Drop a request (client went away). A queued one leaves the queue now; a running one
        frees its slot at the next round boundary."""
        with self._cv:
            if req.finished:
                return
            req.cancelled = True
            if req in self._waiting:
                self._waiting.remove(req)
                self.metrics.queue_depth.set(len(self._waiting))
                self._finish(req, "abort")
            self._cv.notify()

    def num_free_slots(self) -> int:
        return self.max_batch_size - self._num_active() - self._num_prefilling()

    def _num_prefilling(self) -> int:
        return sum(len(j.reqs) for j in self._prefills)

    def _num_active(self) -> int:
        return sum(r is not None for r in self._slots)

    def stats(self) -> dict[str, int]:
        with self._cv:
            return {
                "active": self._num_active(),
                "prefilling": self._num_prefilling(),
                "waiting": len(self._waiting),
                "slots": self.max_batch_size,
                "rows": len(self._slots),
            }

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop taking requests; let in-flight ones finish for up to `drain_timeout` s, then
        cancel the rest (they get finish_reason "abort") and stop the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        deadline = time.monotonic() + drain_timeout
        while time.monotonic() < deadline:
            s = self.stats()
            if s["active"] == 0 and s["prefilling"] == 0 and s["waiting"] == 0:
                break
            time.sleep(0.02)
        with self._cv:
            self._abort = True
            left = list(self._waiting) + self._prefilling_requests() + [r for r in self._slots if r is not None]
            self._cv.notify()
        # End them now, from this thread: the engine thread may be in the middle of a long round
        # (or a compile), and every stream must get its last chunk before the server closes.
        for r in left:
            self._finish(r, "abort")
        if self._thread is not None:
            self._thread.join(timeout=30)
        # Anything left (thread died or never started) is failed, never left hanging.
        for r in list(self._waiting) + self._prefilling_requests() + [r for r in self._slots if r is not None]:
            self._finish(r, "abort")
        self._waiting.clear()
        self._prefills.clear()
        self._slots = [None] * len(self._slots)

    # ------------------------------------------------------------------ state

    def _prefill(self, context, tokens, start, lens, max_new, sp, key, greedy, draft_limit=None, *,
                 shapes_only: bool = False):
        # step_jit programs must be called at top level: `.eval_shape` gives their output
        # shapes without staging them inside another trace.
        fn = self._programs.prefill.eval_shape if shapes_only else self._programs.prefill
        if draft_limit is None:  # always an array: one compiled program whatever the requests ask
            draft_limit = jnp.full(lens.shape, self.num_draft_tokens, jnp.int32)
        return fn(self._programs.weights, context, tokens, start, lens, max_new, sp, self._eos, key, draft_limit,
                  greedy=greedy)

    def _context(self, b: int, *, shapes_only: bool = False):
        """An empty prompt context (KV of nothing yet) for a prefill of `b` rows."""
        fn = self._programs.context.eval_shape if shapes_only else self._programs.context
        return fn(self._programs.weights, batch_size=b)

    def _round(self, greedy: bool, speculate: bool = True):
        self._state, out = self._programs.round(self._programs.weights, self._state, jnp.asarray(speculate),
                                                greedy=greedy)
        return jax.device_get(out)

    def _empty_state(self, b: int) -> SpecState:
        t = self.min_prompt_bucket
        if b not in self._state_shapes:
            self._state_shapes[b] = self._prefill(
                self._context(b, shapes_only=True), jnp.zeros((b, t), jnp.int32), jnp.zeros((b,), jnp.int32),
                jnp.ones((b,), jnp.int32), jnp.ones((b,), jnp.int32), SamplingParams.full(b),
                jax.random.split(self._key, b), False, shapes_only=True,
            )
        shapes = self._state_shapes[b]

        # Fresh buffers throughout: the batch state is donated to every jitted step, so it must
        # not share arrays with anything the engine keeps (eos ids, the base key).
        key = jax.random.split(jax.random.fold_in(self._key, 0), b)

        def zeros(s):
            if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
                return key
            return jnp.zeros(s.shape, s.dtype)

        state = jax.tree.map(zeros, shapes)
        return state._replace(done=jnp.ones((b,), bool), eos_ids=jnp.array(self._eos, copy=True), key=key)

    def _warmup(self) -> None:
        """Compile everything a request can meet, so none waits on a compile: every prefill shape
        (`prefill_shapes`) and the prompt chunk, and at every batch bucket the inserts of each
        prefill size, both round variants (greedy and sampled), the finish and the moves to the
        next bucket up and down."""
        t0 = time.perf_counter()
        sizes = sorted({nb for nb, _ in self.prefill_shapes})
        for nb in sizes:  # the small programs first, once each
            jax.block_until_ready((self._context(nb), _keys_from_seeds(jnp.zeros((nb,), jnp.uint32))))

        def compile_prefill(shape):
            nb, t = shape
            sp = SamplingParams.full(nb, 1.0)
            return nb, jax.block_until_ready(self._prefill(
                self._context(nb), jnp.zeros((nb, t), jnp.int32), jnp.zeros((nb,), jnp.int32),
                jnp.ones((nb,), jnp.int32), jnp.full((nb,), 64, jnp.int32), sp,
                _keys_from_seeds(jnp.zeros((nb,), jnp.uint32)), False))

        def compile_chunk():
            c = self.prefill_chunk
            jax.block_until_ready(self._programs.chunk(
                self._programs.weights, self._context(1), jnp.zeros((1, c), jnp.int32), jnp.zeros((1,), jnp.int32),
                jnp.zeros((1,), jnp.int32)))

        # XLA compiles one program on one core: compile the shapes side by side (threads; the
        # compiler releases the GIL), about halving this part of start-up on 2 cores.
        with ThreadPoolExecutor(max_workers=_COMPILE_THREADS) as pool:
            chunk = pool.submit(compile_chunk) if self.max_model_len > self.prefill_chunk else None
            news = dict(pool.map(compile_prefill, self.prefill_shapes))  # rows -> one prefilled state
            if chunk is not None:
                chunk.result()
        log.info("compiled %d prefill shapes (rows x prompt bucket, chunk %d) in %.1fs", len(self.prefill_shapes),
                 self.prefill_chunk, time.perf_counter() - t0)
        new = news[1]

        def compile_bucket(i: int) -> float:
            """Bucket i's programs, on a state of its own (buckets compile side by side)."""
            t1, b = time.perf_counter(), self.buckets[i]
            for nb, rows in news.items():
                if nb > 1:
                    _insert_jit(self._empty_state(b), rows, jnp.full((nb,), b, jnp.int32))
            for greedy in (True, False):
                state = _insert_jit(self._empty_state(b), new, jnp.zeros((1,), jnp.int32))
                state, _ = self._programs.round(self._programs.weights, state, jnp.asarray(True), greedy=greedy)
                state = _finish_jit(state, jnp.ones((b,), bool))
            for small in self.buckets[:i]:  # growing: from any smaller bucket at once
                _insert_jit(self._empty_state(b), self._empty_state(small), jnp.arange(small, dtype=jnp.int32))
            if i > 0:  # shrinking: one bucket down at a time
                state = _take_jit(state, jnp.arange(self.buckets[i - 1], dtype=jnp.int32))
            jax.block_until_ready(state)
            return time.perf_counter() - t1

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=_COMPILE_THREADS) as pool:
            times = list(pool.map(compile_bucket, range(len(self.buckets))))
        log.info("compiled the rounds of batch buckets %s in %.1fs (%s s each, side by side)", list(self.buckets),
                 time.perf_counter() - t0, ", ".join(f"{t:.1f}" for t in times))
        if self._policy is not None:
            self._time_rounds(new)
        self._state = self._empty_state(self.buckets[0])
        self._slots = [None] * self.buckets[0]

    def _time_rounds(self, new: SpecState) -> None:
        """Seed the adaptive policy with measured round costs: at every bucket, greedy and
        sampled, speculative and plain (the first run of each is not counted: it pays one-time
        costs). One live row costs what a full batch does: the shapes are static."""
        for b in self.buckets:
            for greedy in (True, False):
                for speculate in (True, False):
                    state = _insert_jit(self._empty_state(b), new, jnp.zeros((1,), jnp.int32))
                    for rep in range(3):
                        t1 = time.perf_counter()
                        state, out = self._programs.round(self._programs.weights, state, jnp.asarray(speculate),
                                                          greedy=greedy)
                        jax.device_get(out)
                        if rep:
                            self._policy.observe_round(b, speculate, greedy, time.perf_counter() - t1)
        log.info("measured round costs (ms, rows/speculative/greedy): %s", ", ".join(
            f"{r}/{'S' if s else 'P'}/{'G' if g else 'S'} {1e3 * c:.1f}"
            for (r, s, g), c in sorted(self._policy.cost_table().items())))

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _resize(self, rows: int) -> None:
        """Move the live sequences into a batch of `rows` rows (a bucket that holds them all).

        Growing copies every row into a larger empty batch; shrinking compacts the live rows
        into the first ones. Either way each sequence keeps its whole state, and its request
        learns its new row.
        """
        live = [i for i, r in enumerate(self._slots) if r is not None]
        if rows == len(self._slots) or len(live) > rows:
            return
        if not live:  # nothing to keep
            self._state = self._empty_state(rows)
            self._slots = [None] * rows
        elif rows > len(self._slots):
            old = len(self._slots)
            self._state = _insert_jit(self._empty_state(rows), self._state, jnp.arange(old, dtype=jnp.int32))
            self._slots = self._slots + [None] * (rows - old)
        else:
            free = [i for i, r in enumerate(self._slots) if r is None]
            order = live + free[: rows - len(live)]  # the padding rows are done (free) ones
            self._state = _take_jit(self._state, jnp.asarray(order, jnp.int32))
            self._slots = [self._slots[i] for i in order]
        for i, r in enumerate(self._slots):
            if r is not None:
                r.slot = i
        self._small_rounds = 0
        self.metrics.batch_resizes.inc()
        self.metrics.batch_rows.set(rows)

    def _maybe_shrink(self) -> None:
        """Compact one bucket down once the live sequences have fit it for `shrink_after`
        rounds; straight to the smallest bucket when none is left."""
        n = self._num_active()
        if n == 0:
            self._resize(self.buckets[0])
            return
        i = self.buckets.index(len(self._slots))
        if i == 0 or n > self.buckets[i - 1]:
            self._small_rounds = 0
            return
        self._small_rounds += 1
        if self._small_rounds >= self.shrink_after:
            self._resize(self.buckets[i - 1])

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._abort or self._waiting or self._prefills or self._any_active()
                           or self._any_cancelled()):
                    self._cv.wait()
                if self._abort:
                    break
                admit: list[GenRequest] = []
                while self._waiting and len(admit) < self.num_free_slots():
                    r = self._waiting.popleft()
                    if r.cancelled:
                        self._finish(r, "abort")
                    else:
                        admit.append(r)
                self._prefills.extend(self._group(admit))
                self.metrics.queue_depth.set(len(self._waiting))
            try:
                self._free_cancelled()
                if self._prefills:  # one prefill unit per step: a long prompt never stalls the rest for long
                    self._prefill_step()
                if self._any_active():
                    self._step()
                self._maybe_shrink()
            except Exception as e:  # keep serving: fail the requests in flight, reset the batch
                log.exception("engine step failed")
                with self._cv:
                    failed = self._prefilling_requests() + [r for r in self._slots if r is not None]
                    self._prefills.clear()
                for r in failed:
                    self._fail(r, f"internal error in the engine: {type(e).__name__}: {e}")
                self._slots = [None] * self.buckets[0]
                self._state = self._empty_state(self.buckets[0])
                self.metrics.batch_rows.set(self.buckets[0])
            self.metrics.batch_occupancy.set(self._num_active())
        # abort: everything still here ends as "abort"
        with self._cv:
            rest = list(self._waiting) + self._prefilling_requests() + [r for r in self._slots if r is not None]
            self._waiting.clear()
            self._prefills.clear()
            self._slots = [None] * len(self._slots)
        for r in rest:
            self._finish(r, "abort")

    def _any_active(self) -> bool:
        return any(r is not None for r in self._slots)

    def _any_cancelled(self) -> bool:
        return any(r is not None and r.cancelled for r in self._slots)

    def _prefilling_requests(self) -> list[GenRequest]:
        return [r for j in self._prefills for r in j.reqs]

    def _release(self, slots: list[int]) -> None:
        if not slots:
            return
        mask = np.zeros((len(self._slots),), bool)
        mask[slots] = True
        self._state = _finish_jit(self._state, jnp.asarray(mask))
        for s in slots:
            self._slots[s] = None

    def _free_cancelled(self) -> None:
        gone = [i for i, r in enumerate(self._slots) if r is not None and r.cancelled]
        for i in gone:
            self._finish(self._slots[i], "abort")
        self._release(gone)
        with self._cv:  # requests still being prefilled leave their job (a chunked prompt's job ends)
            for job in self._prefills:
                for r in job.reqs:
                    if r.cancelled:
                        self._finish(r, "abort")
                job.reqs = [r for r in job.reqs if not r.cancelled]
            self._prefills = deque(j for j in self._prefills if j.reqs)

    def _group(self, reqs: list[GenRequest]) -> list[_PrefillJob]:
        """Admitted requests -> prefill jobs, in order: short prompts share a job while it stays
        within `max_prefill_batch` prompts and `prefill_chunk` token rows (padding included); a
        prompt longer than the chunk gets a job of its own, run chunk by chunk."""
        jobs: list[_PrefillJob] = []
        group: list[GenRequest] = []
        for r in reqs:
            if len(r.prompt_ids) > self.prefill_chunk:
                jobs.append(_PrefillJob([r]))
                continue
            trial = group + [r]
            rows = _pow2(len(trial)) * prompt_bucket(max(len(q.prompt_ids) for q in trial), self.min_prompt_bucket)
            if group and (len(trial) > self.max_prefill_batch or rows > self.prefill_chunk):
                jobs.append(_PrefillJob(group))
                trial = [r]
            group = trial
        if group:
            jobs.append(_PrefillJob(group))
        return jobs

    def _prefill_step(self) -> None:
        """One unit of prefill work: the next chunk of a long prompt, or a job's final prefill
        (its requests then join the batch and get their first token)."""
        job = self._prefills[0]
        r = job.reqs[0]
        if len(r.prompt_ids) - job.written > self.prefill_chunk:
            c, w = self.prefill_chunk, job.written
            try:
                if job.context is None:
                    job.context = self._context(1)
                job.context = self._programs.chunk(
                    self._programs.weights, job.context, jnp.asarray([r.prompt_ids[w : w + c]], jnp.int32),
                    jnp.asarray([r.prompt_ids[w + c]], jnp.int32), jnp.full((1,), w, jnp.int32))
                job.written += c
            except Exception as e:  # noqa: BLE001 - this request fails alone
                log.exception("prefill chunk of request %d failed", r.id)
                with self._cv:
                    self._prefills.popleft()
                self._fail(r, f"internal error in the engine: {type(e).__name__}")
            return
        with self._cv:
            self._prefills.popleft()
        self._prefill_isolated(job.reqs, job.context, job.written)

    def _prefill_isolated(self, reqs: list[GenRequest], context=None, start: int = 0) -> None:
        """Prefill a group; if it fails, prefill its requests one by one, so a request that
        breaks its prefill fails alone and its group-mates start as if it had never come."""
        try:
            new = self._prefill_rows(reqs, context, start)
        except Exception as e:  # noqa: BLE001 - whatever broke, it must not spread
            if len(reqs) > 1:
                log.warning("prefill of %d requests failed (%s); retrying them one by one", len(reqs), e)
                for r in reqs:
                    self._prefill_isolated([r])
                return
            log.exception("prefill of request %d failed", reqs[0].id)
            self._fail(reqs[0], f"internal error in the engine: {type(e).__name__}")
            return
        self._insert(reqs, *new)

    def _prefill_rows(self, reqs: list[GenRequest], context=None, start: int = 0):
        """Run the final prefill of a group (no engine state touched): (new state rows, host arrays).

        `context` holds the KV of the first `start` prompt positions (a chunked long prompt);
        without one, the prompts start from nothing.
        """
        n = len(reqs)
        nb = _pow2(n)
        t = prompt_bucket(max(len(r.prompt_ids) - start for r in reqs), self.min_prompt_bucket)
        tokens = np.zeros((nb, t), np.int32)
        lens = np.ones((nb,), np.int32)
        max_new = np.ones((nb,), np.int32)
        temp = np.zeros((nb,), np.float32)
        top_k = np.zeros((nb,), np.int32)
        top_p = np.ones((nb,), np.float32)
        limit = np.full((nb,), self.num_draft_tokens, np.int32)
        for i, r in enumerate(reqs):
            tokens[i, : len(r.prompt_ids) - start] = r.prompt_ids[start:]
            lens[i] = len(r.prompt_ids)
            max_new[i] = r.max_new_tokens
            temp[i], top_k[i], top_p[i] = r.temperature, r.top_k, r.top_p
            if r.num_speculative_tokens is not None:
                limit[i] = r.num_speculative_tokens
        # One PRNG key per sequence: a request with a seed gets the same samples whatever
        # else is in the batch (spec_round advances each key by the row's own round count).
        seeds = np.zeros((nb,), np.uint32)
        for i, r in enumerate(reqs):
            if r.seed is not None:
                seeds[i] = r.seed % 2**32
            else:
                seeds[i] = self._seed_rng.integers(0, 2**32, dtype=np.uint32)
        key = _keys_from_seeds(jnp.asarray(seeds))
        sp = SamplingParams(jnp.asarray(temp), jnp.asarray(top_k), jnp.asarray(top_p))
        if context is None:
            context = self._context(nb)
        # The sampling path is exact for temperature-0 rows too (argmax), and one first token
        # per row is cheap: one prefill compilation per shape instead of two.
        new = self._prefill(context, jnp.asarray(tokens), jnp.full((nb,), start, jnp.int32), jnp.asarray(lens),
                            jnp.asarray(max_new), sp, key, False, jnp.asarray(limit))
        first, done, hit_eos = jax.device_get((new.output[:, 0], new.done, new.hit_eos))
        return new, lens, first, done, hit_eos

    def _insert(self, reqs: list[GenRequest], new, lens, first, done, hit_eos) -> None:
        """Give prefilled requests free rows (growing the batch if needed), write their rows in
        and emit each request's first token."""
        n = len(reqs)
        self._resize(max(len(self._slots), self._bucket(self._num_active() + n)))
        free = [i for i, r in enumerate(self._slots) if r is None]
        slots = np.full((new.last_token.shape[0],), len(self._slots), np.int32)  # padding rows: dropped
        for i, (r, s) in enumerate(zip(reqs, free, strict=False)):
            r.slot = s
            self._slots[s] = r
            slots[i] = s
        self._state = _insert_jit(self._state, new, jnp.asarray(slots))
        now = time.perf_counter()
        self.metrics.prompt_tokens.inc(int(lens[:n].sum()))
        finished = []
        for i, r in enumerate(reqs):
            r.first_token_time = now
            self.metrics.ttft.observe(now - r.arrival)
            if self._emit(r, [int(first[i])]) or done[i]:
                self._finish(r, "stop" if (hit_eos[i] or r.stopper.hit) else "length")
                finished.append(r.slot)
        self._release(finished)

    def _draft_cap(self, r: GenRequest) -> int:
        return self.num_draft_tokens if r.num_speculative_tokens is None else r.num_speculative_tokens

    def _step(self) -> None:
        active = [r for r in self._slots if r is not None]
        greedy = all(r.temperature <= 0 for r in active)
        rows = len(self._slots)
        speculate = any(self._draft_cap(r) > 0 for r in active)  # else the round is plain anyway
        # A seeded sampled request's text is reproducible whatever shares its batch only if its
        # rounds are speculative or not independently of the others: rounds it is in always are.
        pinned = any(r.seed is not None and r.temperature > 0 for r in active)
        if speculate and self._policy is not None and not pinned:
            expected = [self._policy.expected_tokens(r.accepted_tokens, r.spec_rounds, self._draft_cap(r))
                        for r in active]
            speculate = self._policy.choose(rows, greedy, expected)
            self.metrics.adaptive_rounds.labels(choice="speculate" if speculate else "plain").inc()
        t0 = time.perf_counter()
        toks, counts, done, hit_eos, accepted = self._round(greedy, speculate)
        if self._policy is not None:
            self._policy.observe_round(rows, speculate, greedy, time.perf_counter() - t0)
            kind = f"{'speculative' if speculate else 'plain'}_{'greedy' if greedy else 'sampled'}"
            self.metrics.round_seconds.labels(rows=str(rows), round=kind).set(
                self._policy.cost(rows, speculate, greedy))
        self.metrics.engine_steps.inc()
        finished = []
        for s, r in enumerate(self._slots):
            if r is None:
                continue
            self.metrics.rounds.inc()
            m = int(accepted[s])
            r.accepted_tokens += m
            r.target_forwards += 1
            if speculate and self._draft_cap(r) > 0:
                r.spec_rounds += 1
                if self._policy is not None:
                    self._policy.observe_acceptance(m)
            self.metrics.acceptance_length.observe(m + 1)
            for pos in range(m):
                self.metrics.accepted.labels(position=str(pos + 1)).inc()
            stopped = self._emit(r, toks[s, : counts[s]].tolist())
            if stopped or done[s]:
                self._finish(r, "stop" if (hit_eos[s] or r.stopper.hit) else "length")
                finished.append(s)
        self._release(finished)

    # ------------------------------------------------------------------ per request

    def _decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _emit(self, r: GenRequest, tokens: list[int]) -> bool:
        """Feed new tokens through the detokenizer and stop strings; True once a stop string hit."""
        if r.detok is None:
            r.detok = IncrementalDetokenizer(self._decode)
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
        if text:
            r.sink(Delta(text, used))
        return r.stopper.hit

    def _claim_end(self, r: GenRequest) -> bool:
        """True exactly once per request: whoever ends it (engine thread, a cancel, a drain)."""
        with self._end_lock:
            if r.finished:
                return False
            r.finished = True
            return True

    def _finish(self, r: GenRequest, reason: str) -> None:
        if not self._claim_end(r):
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

    def _fail(self, r: GenRequest, message: str) -> None:
        if not self._claim_end(r):
            return
        self.metrics.requests.labels(finish_reason="error").inc()
        r.sink(Failed(message))

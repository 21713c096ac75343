"""The engine's step runner, the device side: the jitted programs (`Programs`, and the insert /
finish / take moves of batch rows) and the batch state, one `SpecState` with a row per scheduler
slot. It builds a prefill's arrays from requests (`prefill_rows`), runs prompt chunks and rounds,
writes prefilled rows in, marks rows done and resizes the batch (`resize`, as the scheduler's
`resize_plan` says). `warmup` compiles every program a request can meet, then, for an adaptive
policy, measures every kind of round (`_time_rounds`)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.generate.speculative import cache_capacity, prompt_bucket
from peagle_jax.generate.steps import SpecConfig, SpecState
from peagle_jax.sampling import SamplingParams
from peagle_jax.serve.adaptive import AdaptivePolicy
from peagle_jax.serve.programs import Programs, finish_jit, insert_jit, keys_from_seeds, take_jit
from peagle_jax.serve.requests import GenRequest
from peagle_jax.serve.scheduler import pow2

log = logging.getLogger("peagle_jax.serve")

__all__ = ["Job", "Runner", "Wave", "release_free_memory", "run_waves"]

_COMPILE_THREADS = max(1, min(4, os.cpu_count() or 1))  # programs the warm-up compiles side by side

Job = tuple[str, Callable[[], object]]  # a name for logs and /health, and what it runs
Wave = list[Job]  # jobs that may run side by side


def release_free_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc's `malloc_trim`; elsewhere a
    no-op). XLA's compiles free most of what they allocate, but glibc keeps it: after the
    default server's warm-up the process held 8.0 GB, 2.9 GB of it in use
    (results/serve_startup/README.md)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def run_waves(waves: Sequence[Wave], on_done: Callable[[str], None] = lambda name: None) -> None:
    """Run the waves one after another, each wave's jobs side by side (XLA compiles one program
    on one core; the compiler releases the GIL, so threads about halve a warm-up on 2 cores)."""
    with ThreadPoolExecutor(max_workers=_COMPILE_THREADS) as pool:
        for wave in waves:
            t0 = time.perf_counter()
            list(pool.map(lambda job: job[1](), wave))
            release_free_memory()  # before the wave is reported done: a caller that sees it done sees the memory too
            for name, _ in wave:
                on_done(name)
            log.info("warm-up: %s in %.1fs", ", ".join(n for n, _ in wave), time.perf_counter() - t0)


class Runner:
    """The compiled programs and the device batch state (`state`); no request bookkeeping."""

    def __init__(self, target, drafter, eos_ids: Sequence[int], *, method: str, num_draft_tokens: int,
                 max_model_len: int, seed: int, min_prompt_bucket: int, policy: AdaptivePolicy | None = None):
        """num_draft_tokens: K, 0 for method "none" (whose drafter, if any, is not used)."""
        # Greedy is chosen per round (all rows greedy or not); the rest is fixed per engine. Head
        # methods also compile a plain round: when no sequence may take drafts (requests that
        # turn speculation off, or the adaptive policy), a round costs one decode step.
        k = num_draft_tokens
        spec = SpecConfig(method, k, True, cache_capacity(max_model_len, 0, k), max_model_len,
                          plain_rounds=method in ("eagle3", "peagle"))
        spec.check_drafter(drafter)
        max_ctx = target.config.max_position_embeddings
        if max_model_len > max_ctx:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context ({max_ctx})")
        self.spec, self.num_draft_tokens = spec, k
        self.min_prompt_bucket = min_prompt_bucket
        self.policy = policy  # the adaptive policy `_time_rounds` seeds; None: not adaptive
        self.programs = Programs(target, drafter if method != "none" else None, spec)
        self.eos = jnp.asarray(np.array(list(eos_ids) or [-1], np.int32))
        self.key = jax.random.key(seed)
        self.seed_rng = np.random.default_rng(seed)  # seeds for requests that give none
        self.state: SpecState | None = None
        self._state_shapes: dict[int, SpecState] = {}  # batch rows -> SpecState shapes

    # ------------------------------------------------------------------ programs

    def prefill(self, context, tokens, start, lens, max_new, sp, key, greedy, draft_limit=None, *,
                shapes_only: bool = False):
        # step_jit programs must be called at top level: `.eval_shape` gives their output
        # shapes without staging them inside another trace.
        fn = self.programs.prefill.eval_shape if shapes_only else self.programs.prefill
        if draft_limit is None:  # always an array: one compiled program whatever the requests ask
            draft_limit = jnp.full(lens.shape, self.num_draft_tokens, jnp.int32)
        return fn(self.programs.weights, context, tokens, start, lens, max_new, sp, self.eos, key, draft_limit,
                  greedy=greedy)

    def context(self, b: int, *, shapes_only: bool = False):
        """An empty prompt context (KV of nothing yet) for a prefill of `b` rows."""
        fn = self.programs.context.eval_shape if shapes_only else self.programs.context
        return fn(self.programs.weights, batch_size=b)

    def chunk(self, context, ids: list[int], start: int, size: int):
        """Write prompt positions start..start+size of a 1-row prefill into `context` (None: a
        new one); returns the context. `ids[start + size]` exists: the chunk is never the last."""
        if context is None:
            context = self.context(1)
        return self.programs.chunk(
            self.programs.weights, context, jnp.asarray([ids[start : start + size]], jnp.int32),
            jnp.asarray([ids[start + size]], jnp.int32), jnp.full((1,), start, jnp.int32))

    def _round_program(self, state: SpecState, speculate: bool, greedy: bool):
        return self.programs.round(self.programs.weights, state, jnp.asarray(speculate), greedy=greedy)

    def round(self, greedy: bool, speculate: bool = True):
        """One round over the batch: (tokens, counts, done, hit_eos, accepted) per row, on the host."""
        self.state, out = self._round_program(self.state, speculate, greedy)
        return jax.device_get(out)

    def prefill_rows(self, reqs: list[GenRequest], context=None, start: int = 0):
        """Run the final prefill of a group (the batch state untouched): (new state rows, host arrays).

        `context` holds the KV of the first `start` prompt positions (a chunked long prompt);
        without one, the prompts start from nothing.
        """
        n = len(reqs)
        nb = pow2(n)
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
                seeds[i] = self.seed_rng.integers(0, 2**32, dtype=np.uint32)
        key = keys_from_seeds(jnp.asarray(seeds))
        sp = SamplingParams(jnp.asarray(temp), jnp.asarray(top_k), jnp.asarray(top_p))
        if context is None:
            context = self.context(nb)
        # The sampling path is exact for temperature-0 rows too (argmax), and one first token
        # per row is cheap: one prefill compilation per shape instead of two.
        new = self.prefill(context, jnp.asarray(tokens), jnp.full((nb,), start, jnp.int32), jnp.asarray(lens),
                           jnp.asarray(max_new), sp, key, False, jnp.asarray(limit))
        first, done, hit_eos = jax.device_get((new.output[:, 0], new.done, new.hit_eos))
        return new, lens, first, done, hit_eos

    # ------------------------------------------------------------------ batch state

    def empty_state(self, b: int) -> SpecState:
        t = self.min_prompt_bucket
        if b not in self._state_shapes:
            self._state_shapes[b] = self.prefill(
                self.context(b, shapes_only=True), jnp.zeros((b, t), jnp.int32), jnp.zeros((b,), jnp.int32),
                jnp.ones((b,), jnp.int32), jnp.ones((b,), jnp.int32), SamplingParams.full(b),
                jax.random.split(self.key, b), False, shapes_only=True,
            )
        shapes = self._state_shapes[b]

        # Fresh buffers throughout: the batch state is donated to every jitted step, so it must
        # not share arrays with anything the engine keeps (eos ids, the base key).
        key = jax.random.split(jax.random.fold_in(self.key, 0), b)

        def zeros(s):
            if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
                return key
            return jnp.zeros(s.shape, s.dtype)

        state = jax.tree.map(zeros, shapes)
        return state._replace(done=jnp.ones((b,), bool), eos_ids=jnp.array(self.eos, copy=True), key=key)

    def reset(self, rows: int) -> None:
        """An empty batch of `rows` rows (whatever was in it is dropped)."""
        self.state = self.empty_state(rows)

    def insert(self, new: SpecState, slots: np.ndarray) -> None:
        """Write prefilled rows into the batch rows `slots` (an out-of-range row is dropped)."""
        self.state = insert_jit(self.state, new, jnp.asarray(slots))

    def finish_rows(self, rows: list[int], batch_rows: int) -> None:
        """Mark `rows` of the `batch_rows`-row batch done (they stay frozen, free for new rows)."""
        mask = np.zeros((batch_rows,), bool)
        mask[rows] = True
        self.state = finish_jit(self.state, jnp.asarray(mask))

    def resize(self, rows: int, order: list[int]) -> None:
        """A batch of `rows` rows made of the old rows `order` (`Scheduler.resize_plan`): each
        sequence keeps its whole state (KV, pending rows, PRNG key)."""
        if not order:  # nothing to keep
            self.state = self.empty_state(rows)
        elif len(order) < rows:  # growing: every old row, in place
            self.state = insert_jit(self.empty_state(rows), self.state, jnp.arange(len(order), dtype=jnp.int32))
        else:
            self.state = take_jit(self.state, jnp.asarray(order, jnp.int32))

    # ------------------------------------------------------------------ warm-up

    def warmup_plan(self, buckets: Sequence[int], shapes: Sequence[tuple[int, int]], chunk: int, *,
                    with_chunk: bool = True, first_prompt_bucket: int = 64) -> tuple[list[Wave], list[Wave]]:
        """Every program a request can meet, in two plans of named jobs: what the server needs
        before it says ready (one-row prefills of prompts up to `first_prompt_bucket` tokens, and
        the programs of the smallest batch bucket), and the rest, which may compile while it
        serves (a request that meets a program not yet compiled waits for that compile).

        A plan is a list of waves run one after another; a wave's jobs compile side by side (the
        greedy and sampled rounds of a bucket too). Jobs work on states of their own, never on
        `self.state`. With an adaptive policy, a last wave measures the plan's buckets' rounds
        (`_time_rounds`), apart from the compiles.
        """
        news: dict[int, SpecState] = {}  # {1: a prefilled one-row state}, which the timing rounds decode
        prefill_sizes = sorted({nb for nb, _ in shapes})

        def prefill(shape: tuple[int, int]) -> None:
            nb, t = shape
            new = jax.block_until_ready(self.prefill(
                self.context(nb), jnp.zeros((nb, t), jnp.int32), jnp.zeros((nb,), jnp.int32),
                jnp.ones((nb,), jnp.int32), jnp.full((nb,), 64, jnp.int32), SamplingParams.full(nb, 1.0),
                keys_from_seeds(jnp.zeros((nb,), jnp.uint32)), False))
            if nb == 1:
                news[1] = new

        def prompt_chunk() -> None:
            jax.block_until_ready(self.programs.chunk(
                self.programs.weights, self.context(1), jnp.zeros((1, chunk), jnp.int32),
                jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32)))

        def timing(bs: Sequence[int]) -> Wave:
            if self.policy is None:
                return []
            return [(f"timing the rounds at {list(bs)} rows", lambda: self._time_rounds(bs, news[1]))]

        def bucket_jobs(i: int) -> list[Job]:
            b = buckets[i]
            rounds = [(f"{kind} round at {b} rows", functools.partial(self._compile_round, b, kind == "greedy"))
                      for kind in ("greedy", "sampled")]
            moves = functools.partial(self._compile_moves, buckets, prefill_sizes, i)
            return rounds + [(f"row moves at {b} rows", moves)]

        def plan(shape_list, bucket_ids, extra=()) -> list[Wave]:
            compiles = [(f"prefill {nb}x{t}", functools.partial(prefill, (nb, t))) for nb, t in shape_list]
            compiles += list(extra) + [job for i in bucket_ids for job in bucket_jobs(i)]
            return [w for w in (compiles, timing([buckets[i] for i in bucket_ids])) if w]

        first_shapes = [(nb, t) for nb, t in shapes if nb == 1 and t <= first_prompt_bucket] or [min(shapes)]
        rest_shapes = [s for s in shapes if s not in first_shapes]
        chunk_job = [(f"prompt chunk {chunk}", prompt_chunk)] if with_chunk else []
        return plan(first_shapes, [0]), plan(rest_shapes, range(1, len(buckets)), chunk_job)

    def warmup(self, buckets: Sequence[int], shapes: Sequence[tuple[int, int]], chunk: int, *,
               with_chunk: bool = True) -> None:
        """Compile (and time) everything `warmup_plan` lists, here and now; then an empty batch."""
        first, rest = self.warmup_plan(buckets, shapes, chunk, with_chunk=with_chunk)
        run_waves(first + rest)
        self.state = self.empty_state(buckets[0])

    def _one_row(self, b: int, new: SpecState) -> SpecState:
        """A `b`-row batch with the first row of `new` in row 0."""
        return insert_jit(self.empty_state(b), new, jnp.zeros((1,), jnp.int32))

    def _compile_round(self, b: int, greedy: bool) -> None:
        """The round program at `b` rows (greedy or sampled), run once on an empty batch."""
        jax.block_until_ready(self._round_program(self.empty_state(b), True, greedy))

    def _compile_moves(self, buckets: Sequence[int], prefill_sizes: Sequence[int], i: int) -> None:
        """Bucket i's row moves: the inserts of each prefill size, the finish, the growth from any
        smaller bucket (at once) and the shrink to the next one down. Only shapes matter here:
        empty states stand in for prefilled rows."""
        b = buckets[i]
        for nb in prefill_sizes:
            insert_jit(self.empty_state(b), self.empty_state(nb), jnp.full((nb,), b, jnp.int32))
        state = finish_jit(self.empty_state(b), jnp.ones((b,), bool))
        for small in buckets[:i]:
            insert_jit(self.empty_state(b), self.empty_state(small), jnp.arange(small, dtype=jnp.int32))
        if i > 0:
            state = take_jit(state, jnp.arange(buckets[i - 1], dtype=jnp.int32))
        jax.block_until_ready(state)

    def _time_rounds(self, buckets: Sequence[int], new: SpecState) -> None:
        """Seed the adaptive policy with measured round costs: at each of `buckets`, greedy and
        sampled, speculative and plain (the first run of each is not counted: it pays one-time
        costs). One live row costs what a full batch does: the shapes are static."""
        for b in buckets:
            for greedy in (True, False):
                for speculate in (True, False):
                    state = self._one_row(b, new)
                    for rep in range(3):
                        t1 = time.perf_counter()
                        state, out = self._round_program(state, speculate, greedy)
                        jax.device_get(out)
                        if rep:
                            self.policy.observe_round(b, speculate, greedy, time.perf_counter() - t1)
        log.info("measured round costs (ms, rows/speculative/greedy): %s", ", ".join(
            f"{r}/{'S' if s else 'P'}/{'G' if g else 'S'} {1e3 * c:.1f}"
            for (r, s, g), c in sorted(self.policy.cost_table().items()) if r in buckets))

"""Continuous-batching engine: up to B sequences, one jitted speculative round per step.

The batch state is one `SpecState` with a fixed cache capacity (max_model_len + 2K + 2) and
R rows, R the smallest *batch bucket* (powers of two up to B, and B) that holds the live
sequences. As in vLLM v1 the work is in three parts, which `Engine` composes (the picture:
docs/serving.md): `serve.scheduler.Scheduler` (waiting queue, prefill jobs, batch rows and
buckets: what runs where and when; host only), `serve.runner.Runner` (the jitted programs and
the device batch state: prefills, prompt chunks, rounds, inserts, resizes, warm-up) and
`serve.output.OutputProcessor` (detokenizing, stop strings, the `Delta` / `Finished` / `Failed`
events a request's `sink` receives, the output metrics).

Each step of the loop thread: cancelled rows are marked done; waiting requests, while rows are
free, become prefill jobs, and ONE unit of prefill runs (a chunk of a long prompt, or a job's
final prefill: its rows join the batch, grown to a larger bucket if needed); one round runs over
the R rows; the batch shrinks a bucket once the live sequences have fit it for `shrink_after`
rounds. Sinks are called from the engine thread (the HTTP layer uses `call_soon_threadsafe`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from peagle_jax.generate.speculative import default_num_draft_tokens
from peagle_jax.serve.adaptive import AdaptivePolicy
from peagle_jax.serve.metrics import Metrics
from peagle_jax.serve.output import Delta, Failed, Finished, OutputProcessor, end_reason
from peagle_jax.serve.requests import EngineStopped, GenRequest, QueueFull
from peagle_jax.serve.runner import Runner, release_free_memory, run_waves
from peagle_jax.serve.scheduler import Scheduler, batch_buckets, check_prefill_chunk, check_request, prefill_shapes

log = logging.getLogger("peagle_jax.serve")

__all__ = ["Delta", "Engine", "EngineStopped", "Failed", "Finished", "GenRequest", "QueueFull", "batch_buckets",
           "check_prefill_chunk", "prefill_shapes"]


class Engine:
    """Owns the scheduler, the step runner, the output processor and the loop thread."""

    def __init__(self, target, drafter, tokenizer, eos_ids: Sequence[int], *, method: str = "none",
                 num_draft_tokens: int | None = None, max_batch_size: int = 8, max_model_len: int = 2048,
                 max_queue_size: int = 64, max_prefill_batch: int = 4, min_prompt_bucket: int = 16,
                 prefill_chunk: int = 256, seed: int = 0, metrics: Metrics | None = None, shrink_after: int = 8,
                 adaptive: bool = False):
        """adaptive: choose each round between speculating and a plain decode step by measured
        tokens per second (`serve.adaptive`); head methods (eagle3, peagle) only, else ignored.
        num_draft_tokens None: `generate.default_num_draft_tokens()`."""
        if num_draft_tokens is None:
            num_draft_tokens = default_num_draft_tokens()
        k = num_draft_tokens if method != "none" else 0
        self.adaptive = adaptive and method in ("eagle3", "peagle")
        self.policy = AdaptivePolicy() if self.adaptive else None
        self.runner = Runner(target, drafter, eos_ids, method=method, num_draft_tokens=k, max_model_len=max_model_len,
                             seed=seed, min_prompt_bucket=min_prompt_bucket, policy=self.policy)
        self.method, self.num_draft_tokens, self.max_model_len = method, k, max_model_len
        self.max_batch_size, self.max_queue_size = max_batch_size, max_queue_size
        self.scheduler = Scheduler(max_batch_size, max_queue_size=max_queue_size, max_prefill_batch=max_prefill_batch,
                                   prefill_chunk=prefill_chunk, min_prompt_bucket=min_prompt_bucket,
                                   max_model_len=max_model_len, shrink_after=shrink_after, num_draft_tokens=k)
        self.buckets = self.scheduler.buckets
        self.tokenizer = tokenizer
        self.metrics = metrics or Metrics(k, max_batch_size)
        self.vocab_size = target.config.vocab_size
        self.target = target  # the served model (its weights are what the runner's programs run)
        self.output = OutputProcessor(tokenizer, self.metrics)
        self._cv = threading.Condition()  # guards the scheduler's queue and prefill jobs
        self._thread: threading.Thread | None = None
        self._warm_thread: threading.Thread | None = None
        self._compiling: list[str] = []  # warm-up jobs not yet run (guarded by _cv)
        self._stopping = False  # no new requests
        self._abort = False  # cancel everything and exit
        self.started = False

    # ------------------------------------------------------------------ public API

    def start(self, warmup: bool = True) -> None:
        """Start the loop thread. With `warmup`, first compile what the smallest batch needs
        (`Runner.warmup_plan`), then serve while a background thread compiles the rest
        (`compiling` names what is left; `wait_warm` waits for it)."""
        self.runner.reset(self.buckets[0])
        rest = []
        if warmup:
            t0 = time.perf_counter()
            c = self.scheduler.prefill_chunk
            first, rest = self.runner.warmup_plan(self.buckets, self.scheduler.prefill_shapes, c,
                                                  with_chunk=self.max_model_len > c)
            self._compiling = [name for wave in first + rest for name, _ in wave]
            run_waves(first, self._compiled)
            self.scheduler.reset()
            log.info("engine ready in %.1fs; %d programs left to compile in the background", time.perf_counter() - t0,
                     len(self._compiling))
        self._thread = threading.Thread(target=self._run, name="peagle-engine", daemon=True)
        self._thread.start()
        self.started = True
        if rest:
            self._warm_thread = threading.Thread(target=self._warm_rest, args=(rest,), name="peagle-warmup",
                                                 daemon=True)
            self._warm_thread.start()

    def _compiled(self, name: str) -> None:
        with self._cv:
            self._compiling.remove(name)

    def _warm_rest(self, waves) -> None:
        t0 = time.perf_counter()
        try:
            run_waves(waves, self._compiled)
        except Exception:  # the programs left then compile when a request first needs them
            log.exception("background compile failed; the programs left compile on first use")
            with self._cv:
                self._compiling.clear()
        else:
            log.info("background compile done in %.1fs", time.perf_counter() - t0)

    def compiling(self) -> list[str]:
        """The warm-up jobs still to run (empty once warm)."""
        with self._cv:
            return list(self._compiling)

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait for the background compile; True once nothing is left to compile."""
        if self._warm_thread is not None:
            self._warm_thread.join(timeout)
        return not self.compiling()

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
            room = self.scheduler.room()
            if len(reqs) > room:
                raise QueueFull(f"the server is at capacity: {len(reqs)} sequences asked for, room for {max(room, 0)} "
                                f"({self.max_batch_size} slots, queue of {self.max_queue_size})")
            self.scheduler.waiting.extend(reqs)
            self.metrics.queue_depth.set(len(self.scheduler.waiting))
            self._cv.notify()

    def check_request(self, r: GenRequest) -> None:
        """ValueError naming the first value of `r` the batch arrays cannot hold."""
        check_request(r, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                      num_draft_tokens=self.num_draft_tokens, method=self.method)

    def cancel(self, req: GenRequest) -> None:
        """Drop a request (client went away). A queued one leaves the queue now; a running one
        frees its slot at the next round boundary."""
        with self._cv:
            if req.finished:
                return
            req.cancelled = True
            if req in self.scheduler.waiting:
                self.scheduler.waiting.remove(req)
                self.metrics.queue_depth.set(len(self.scheduler.waiting))
                self.output.finish(req, "abort")
            self._cv.notify()

    def num_free_slots(self) -> int:
        return self.scheduler.num_free_slots()

    def stats(self) -> dict[str, int]:
        with self._cv:
            return self.scheduler.stats()

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop taking requests; let in-flight ones finish for up to `drain_timeout` s, then
        cancel the rest (they get finish_reason "abort") and stop the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        deadline = time.monotonic() + drain_timeout
        while time.monotonic() < deadline and any(map(self.stats().get, ("active", "prefilling", "waiting"))):
            time.sleep(0.02)
        with self._cv:
            self._abort = True
            left = self.scheduler.in_flight()
            self._cv.notify()
        # End them now, from this thread: the engine thread may be in the middle of a long round
        # (or a compile), and every stream must get its last chunk before the server closes.
        for r in left:
            self.output.finish(r, "abort")
        if self._thread is not None:
            self._thread.join(timeout=30)
        # Anything left (thread died or never started) is failed, never left hanging.
        for r in self.scheduler.drain():
            self.output.finish(r, "abort")

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        s = self.scheduler
        while True:
            if not s.has_work():  # going idle: hand back what the rounds freed
                release_free_memory()
            with self._cv:
                while not (self._abort or s.has_work()):
                    self._cv.wait()
                if self._abort:
                    break
                for r in s.admit():  # cancelled while waiting
                    self.output.finish(r, "abort")
                self.metrics.queue_depth.set(len(s.waiting))
            try:
                self._free_cancelled()
                if s.prefills:  # one prefill unit per step: a long prompt never stalls the rest for long
                    self._prefill_step()
                if s.any_active():
                    self._step()
                self._maybe_shrink()
            except Exception as e:  # keep serving: fail the requests in flight, reset the batch
                log.exception("engine step failed")
                with self._cv:
                    failed = s.prefilling_requests() + s.active()
                    s.prefills.clear()
                for r in failed:
                    self.output.fail(r, f"internal error in the engine: {type(e).__name__}: {e}")
                s.reset()
                self.runner.reset(self.buckets[0])
                self.metrics.batch_rows.set(self.buckets[0])
            self.metrics.batch_occupancy.set(s.num_active())
        with self._cv:  # abort: everything still here ends as "abort"
            rest = s.drain()
        for r in rest:
            self.output.finish(r, "abort")

    def _release(self, slots: list[int]) -> None:
        if not slots:
            return
        self.runner.finish_rows(slots, len(self.scheduler.slots))
        self.scheduler.free(slots)

    def _free_cancelled(self) -> None:
        gone = self.scheduler.cancelled_rows()
        for i in gone:
            self.output.finish(self.scheduler.slots[i], "abort")
        self._release(gone)
        with self._cv:  # requests still being prefilled leave their job (a chunked prompt's job ends)
            for r in self.scheduler.drop_cancelled_prefills():
                self.output.finish(r, "abort")

    def _prefill_step(self) -> None:
        """One unit of prefill work: the next chunk of a long prompt, or a job's final prefill
        (its requests then join the batch and get their first token)."""
        job = self.scheduler.prefills[0]
        r, c = job.reqs[0], self.scheduler.prefill_chunk
        if len(r.prompt_ids) - job.written > c:
            try:
                job.context = self.runner.chunk(job.context, r.prompt_ids, job.written, c)
                job.written += c
            except Exception as e:  # noqa: BLE001 - this request fails alone
                log.exception("prefill chunk of request %d failed", r.id)
                with self._cv:
                    self.scheduler.prefills.popleft()
                self.output.fail(r, f"internal error in the engine: {type(e).__name__}")
            return
        with self._cv:
            self.scheduler.prefills.popleft()
        self._prefill_isolated(job.reqs, job.context, job.written)

    def _prefill_isolated(self, reqs: list[GenRequest], context=None, start: int = 0) -> None:
        """Prefill a group; if it fails, prefill its requests one by one, so a request that
        breaks its prefill fails alone and its group-mates start as if it had never come."""
        try:
            new = self.runner.prefill_rows(reqs, context, start)
        except Exception as e:  # noqa: BLE001 - whatever broke, it must not spread
            if len(reqs) > 1:
                log.warning("prefill of %d requests failed (%s); retrying them one by one", len(reqs), e)
                for r in reqs:
                    self._prefill_isolated([r])
                return
            log.exception("prefill of request %d failed", reqs[0].id)
            self.output.fail(reqs[0], f"internal error in the engine: {type(e).__name__}")
            return
        self._insert(reqs, *new)

    def _insert(self, reqs: list[GenRequest], new, lens, first, done, hit_eos) -> None:
        """Give prefilled requests free rows (growing the batch if needed), write their rows in
        and emit each request's first token."""
        self._resize(self.scheduler.rows_for(len(reqs)))
        self.runner.insert(new, self.scheduler.place(reqs, new.last_token.shape[0]))
        self.output.first_tokens(reqs, int(lens[: len(reqs)].sum()))
        finished = []
        for i, r in enumerate(reqs):
            if self.output.emit(r, [int(first[i])]) or done[i]:
                self.output.finish(r, end_reason(r, hit_eos[i]))
                finished.append(r.slot)
        self._release(finished)

    def _resize(self, rows: int) -> None:
        """Move the live sequences into a batch of `rows` rows (a bucket that holds them all)."""
        order = self.scheduler.resize_plan(rows)
        if order is None:
            return
        self.runner.resize(rows, order)
        self.scheduler.apply_resize(rows, order)
        self.metrics.batch_resizes.inc()
        self.metrics.batch_rows.set(rows)

    def _maybe_shrink(self) -> None:
        """Compact one bucket down when the scheduler says so (or to the smallest when empty)."""
        if (rows := self.scheduler.shrink_to()) is not None:
            self._resize(rows)

    def _step(self) -> None:
        s = self.scheduler
        greedy = all(r.temperature <= 0 for r in s.active())
        rows = len(s.slots)
        speculate, chosen = s.speculate(greedy, self.policy)
        if chosen:
            self.metrics.adaptive_rounds.labels(choice="speculate" if speculate else "plain").inc()
        t0 = time.perf_counter()
        toks, counts, done, hit_eos, accepted = self.runner.round(greedy, speculate)
        if self.policy is not None:
            self.policy.observe_round(rows, speculate, greedy, time.perf_counter() - t0)
            kind = f"{'speculative' if speculate else 'plain'}_{'greedy' if greedy else 'sampled'}"
            self.metrics.round_seconds.labels(rows=str(rows), round=kind).set(self.policy.cost(rows, speculate, greedy))
        self.metrics.engine_steps.inc()
        finished = []
        for i, r in enumerate(s.slots):
            if r is None:
                continue
            m, spec = int(accepted[i]), speculate and s.draft_cap(r) > 0
            if spec and self.policy is not None:
                self.policy.observe_acceptance(m)
            if self.output.add_round(r, toks[i, : counts[i]].tolist(), m, spec) or done[i]:
                self.output.finish(r, end_reason(r, hit_eos[i]))
                finished.append(i)
        self._release(finished)

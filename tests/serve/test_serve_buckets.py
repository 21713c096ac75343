"""Rounds sized to the work (#17): the engine computes the smallest batch bucket that holds
its live sequences, grows and compacts between buckets, and no sequence's output changes."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pytest
from test_serve import MAX_LEN, _tiny_models

from peagle_jax.generate import speculative_generate
from peagle_jax.serve.engine import Delta, Engine, Failed, Finished, GenRequest, batch_buckets

K = 3


@pytest.fixture(scope="module")
def models():
    return _tiny_models()


@pytest.mark.parametrize(("max_batch", "buckets"), [(1, (1,)), (2, (1, 2)), (4, (1, 2, 4)), (6, (1, 2, 4, 6)),
                                                    (16, (1, 2, 4, 8, 16))])
def test_batch_buckets_are_powers_of_two_and_the_maximum(max_batch, buckets):
    assert batch_buckets(max_batch) == buckets


class _Run:
    """An engine whose rounds record how many rows they computed and who was live."""

    def __init__(self, models, **kw):
        target, drafter, tok, eos = models
        self.tok = tok
        self.engine = Engine(target, drafter, tok, eos, method="peagle", num_draft_tokens=K,
                             max_model_len=MAX_LEN, **kw)
        self.rows: list[tuple[int, int]] = []  # (rows computed, live sequences) per round
        real = self.engine.runner.round

        def recording_round(greedy, speculate=True):
            self.rows.append((len(self.engine.scheduler.slots), self.engine.scheduler.num_active()))
            return real(greedy, speculate)

        self.engine.runner.round = recording_round
        self.events: dict[int, list] = collections.defaultdict(list)
        self.done = threading.Semaphore(0)

    def request(self, i: int, ids: list[int], max_new: int, **kw) -> GenRequest:
        def sink(ev):
            self.events[i].append(ev)
            if isinstance(ev, Finished | Failed):
                self.done.release()
        return GenRequest(ids, max_new, sink, **{"temperature": 0.0, **kw})

    def text(self, i: int) -> str:
        assert isinstance(self.events[i][-1], Finished), self.events[i][-1]
        return "".join(ev.text for ev in self.events[i])  # Finished carries the last text too


PROMPTS = ["a short one", "the second prompt, a little longer than the first", "third", "4", "fifth and last"]
LENGTHS = [3, 40, 9, 24, 30]


def test_outputs_do_not_change_while_the_batch_grows_and_shrinks(models):
    target, drafter, tok, eos = models
    ids = [tok.encode(p) for p in PROMPTS]
    run = _Run(models, max_batch_size=4, max_prefill_batch=2, shrink_after=1)
    run.engine.start(warmup=False)
    sampled = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    try:
        # 5 requests on 4 rows: the 5th waits; short ones end early, so the batch shrinks
        # 4 -> 2 -> 1 while the long ones run on. Request 3 samples with a seed.
        run.engine.submit_all([run.request(i, ids[i], LENGTHS[i], **(sampled if i == 3 else {}))
                               for i in range(5)])
        for _ in range(5):
            assert run.done.acquire(timeout=300)
    finally:
        run.engine.shutdown()
    greedy = [i for i in range(5) if i != 3]
    for i in greedy:  # greedy: a budget's tokens are the first of a longer one's (one program for all)
        ref = speculative_generate(target, drafter, [ids[i]], method="peagle", num_draft_tokens=K,
                                   max_new_tokens=max(LENGTHS), eos_token_ids=eos)
        assert run.text(i) == tok.decode(ref.tokens[0][:LENGTHS[i]], skip_special_tokens=True), i
    sizes = [r for r, _ in run.rows]
    assert {4, 2, 1} <= set(sizes), sizes  # it grew to 4 and compacted down to 1
    assert all(live <= rows for rows, live in run.rows)
    # once one sequence is left, its rounds compute one row (shrink_after=1: after one round)
    tail = [rows for rows, live in run.rows if live == 1]
    assert tail and tail[-1] == 1 and tail.count(4) == 0, run.rows
    assert run.engine.metrics.batch_resizes._value.get() >= 3

    # The seeded sampled request gives the same text alone on a 1-row engine.
    solo = _Run(models, max_batch_size=1)
    solo.engine.start(warmup=False)
    try:
        solo.engine.submit(solo.request(3, ids[3], LENGTHS[3], **sampled))
        assert solo.done.acquire(timeout=300)
    finally:
        solo.engine.shutdown()
    assert solo.text(3) == run.text(3)
    assert {rows for rows, _ in solo.rows} == {1}


def test_a_lone_stream_computes_one_row_on_a_wide_engine(models):
    run = _Run(models, max_batch_size=8)
    run.engine.start(warmup=False)
    try:
        for i in range(2):  # one after the other, as a client at concurrency 1
            run.engine.submit(run.request(i, run.tok.encode(PROMPTS[i]), 12))
            assert run.done.acquire(timeout=300)
    finally:
        run.engine.shutdown()
    assert run.rows and {rows for rows, _ in run.rows} == {1}, run.rows
    assert run.engine.stats()["rows"] == 1


def test_per_request_draft_limit_keeps_the_text_and_caps_acceptance(models):
    # Prompt lookup on a tiny random target that falls into a loop: drafts get accepted. A
    # request's num_speculative_tokens caps them per round (0: none), sharing one batch with
    # requests at the engine's K, and the greedy text never changes.
    from peagle_jax.drafters.ngram import NgramProposer

    target, _, tok, eos = models
    engine = Engine(target, NgramProposer(), tok, eos, method="ngram", num_draft_tokens=K, max_batch_size=4,
                    max_model_len=MAX_LEN)
    engine.start(warmup=False)
    ends: dict[int, Finished] = {}
    texts: dict[int, list[str]] = collections.defaultdict(list)
    done = threading.Semaphore(0)

    def request(i, limit):
        def sink(ev):
            texts[i].append(ev.text if isinstance(ev, Delta | Finished) else "")
            if isinstance(ev, Finished | Failed):
                ends[i] = ev
                done.release()
        return GenRequest(tok.encode("one two three one two three one two"), 60, sink, temperature=0.0,
                          num_speculative_tokens=limit)

    try:
        engine.submit_all([request(0, None), request(1, 0), request(2, 1)])
        for _ in range(3):
            assert done.acquire(timeout=300)
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            engine.submit(request(3, K + 1))
    finally:
        engine.shutdown()
    assert len({"".join(texts[i]) for i in range(3)}) == 1
    full, off, one = ends[0], ends[1], ends[2]
    assert full.accepted_tokens > 0  # precondition: lookup drafts do get accepted here
    assert off.accepted_tokens == 0 and off.target_forwards == off.completion_tokens - 1
    assert one.accepted_tokens <= one.target_forwards  # the per-row cap itself: tests/generate/test_sampling.py


def test_prefill_shapes_are_bounded_by_the_chunk():
    from peagle_jax.serve.engine import check_prefill_chunk, prefill_shapes

    shapes = prefill_shapes(4, 64, 16)
    assert shapes == ((1, 16), (1, 24), (1, 32), (1, 48), (1, 64), (2, 16), (2, 24), (2, 32), (4, 16))
    assert all(b * t <= 64 for b, t in shapes)
    assert prefill_shapes(3, 32, 16) == ((1, 16), (1, 24), (1, 32), (2, 16))  # 3 prompts pad to 4 rows: > 32
    assert prefill_shapes(1, 256, 16, max_prompt_len=40) == ((1, 16), (1, 24), (1, 32), (1, 48))
    for bad in (40, 8, 100):
        with pytest.raises(ValueError, match="must be a prompt bucket"):
            check_prefill_chunk(bad, 16)


def _compiled(engine):
    """How many programs each of the engine's jitted functions holds."""
    from peagle_jax.serve import programs as mod

    fns = dict(vars(engine.runner.programs))
    fns.pop("weights")
    fns |= {n: getattr(mod, n) for n in ("insert_jit", "finish_jit", "take_jit", "keys_from_seeds")}
    return {name: fn._cache_size() for name, fn in fns.items()}


@pytest.mark.slow
def test_long_prompts_prefill_in_chunks_between_rounds_and_nothing_compiles_after_warmup(models):
    # A 100-token prompt on a 32-token chunk: three chunks and a 4-token tail, each run
    # between two rounds of the stream already decoding; short prompts arriving together
    # share a prefill. Every output equals speculative_generate's, and no request compiles
    # anything: the warm-up compiled every shape.
    target, drafter, tok, eos = models
    run = _Run(models, max_batch_size=4, max_prefill_batch=2, prefill_chunk=32)
    calls: list[str] = []
    run.engine.start(warmup=True)
    assert run.engine.wait_warm(timeout=600)  # the background part of the warm-up too
    compiled = _compiled(run.engine)
    programs = run.engine.runner.programs
    real_chunk, real_round = programs.chunk, run.engine.runner.round

    def chunk(*a, **kw):
        calls.append("chunk")
        return real_chunk(*a, **kw)

    def round_(greedy, speculate=True):
        calls.append("round")
        return real_round(greedy, speculate)

    programs.chunk, run.engine.runner.round = chunk, round_
    rng = np.random.default_rng(0)
    long_ids = rng.integers(10, 40000, 100).tolist()
    prompts = {0: tok.encode(PROMPTS[1]), 1: long_ids, 2: tok.encode(PROMPTS[0]), 3: tok.encode(PROMPTS[2])}
    lengths = {0: 40, 1: 12, 2: 10, 3: 16}
    try:
        run.engine.submit(run.request(0, prompts[0], lengths[0]))
        while not calls:  # request 0 is decoding
            time.sleep(0.01)
        run.engine.submit_all([run.request(i, prompts[i], lengths[i], **({"temperature": 0.8, "seed": 7}
                                                                           if i == 3 else {})) for i in (1, 2, 3)])
        for _ in range(4):
            assert run.done.acquire(timeout=300)
    finally:
        run.engine.shutdown()
        programs.chunk = real_chunk
    for i in (0, 1, 2):
        ref = speculative_generate(target, drafter, [prompts[i]], method="peagle", num_draft_tokens=K,
                                   max_new_tokens=lengths[i], eos_token_ids=eos)
        assert run.text(i) == tok.decode(ref.tokens[0], skip_special_tokens=True), i
    assert calls.count("chunk") == 3, calls
    first = calls.index("chunk")
    assert calls[first:first + 6] == ["chunk", "round"] * 3, calls  # request 0 decodes between the chunks
    assert _compiled(run.engine) == compiled


@pytest.mark.slow
def test_engine_load_benchmark_counts_every_token_and_times_the_phases(models):
    """benchmarks.engine_load's closed loop: every request runs to its budget (no EOS ids), with
    at most `concurrency` in flight, and the phase timer sees the rounds and prefills."""
    from benchmarks.engine_load import PhaseTimer, closed_loop

    target, drafter, tok, _ = models
    engine = Engine(target, drafter, tok, [], method="peagle", num_draft_tokens=K, max_batch_size=2,
                    max_model_len=MAX_LEN)
    timer = PhaseTimer(engine)
    live, peak = [0], [0]
    real_insert = engine._insert

    def counting_insert(reqs, *a):
        real_insert(reqs, *a)
        live[0] = engine.scheduler.num_active()
        peak[0] = max(peak[0], live[0])

    engine._insert = counting_insert
    engine.start(warmup=False)
    try:
        prompts = [tok.encode(p) for p in PROMPTS]
        tokens, seconds = closed_loop(engine, prompts, concurrency=2, max_new=6)
    finally:
        engine.shutdown()
    assert tokens == 6 * len(PROMPTS) and seconds > 0
    assert peak[0] == 2  # two clients: never more than two sequences in the batch
    assert 1 <= timer.calls["runner.prefill_rows"] <= len(PROMPTS)
    assert timer.calls["runner.round"] >= 6 * len(PROMPTS) // 2 // (K + 1)
    assert timer.seconds["_step"] >= timer.seconds["runner.round"] > 0

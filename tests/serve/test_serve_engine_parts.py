"""The serving engine's three parts on their own (`serve.engine` composes them):

* the scheduler (`serve.scheduler`): admission, prefill grouping, batch rows and buckets, the
  round's kind, request checks. Pure Python: requests with no model behind them.
* the output processor (`serve.output`): detokenizing, stop strings, events, metrics, and one
  end per request. Pure Python: a character tokenizer.
* the step runner (`serve.runner`): the jitted programs on the batch state, with the tiny
  random target and head of `conftest.py` (vocabulary 64): its rounds give speculative_generate's
  tokens, resizes and finishes keep every other row's output, and warm-up compiles everything.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from peagle_jax.serve.adaptive import AdaptivePolicy
from peagle_jax.serve.metrics import Metrics
from peagle_jax.serve.output import Delta, Failed, Finished, OutputProcessor, end_reason
from peagle_jax.serve.requests import GenRequest
from peagle_jax.serve.scheduler import Scheduler, check_request


def _ignore(event) -> None:
    """A request's sink where a test reads the engine's state, not its events."""


def _req(n: int = 4, **kw) -> GenRequest:
    return GenRequest(list(range(1, n + 1)), kw.pop("max_new", 8), kw.pop("sink", _ignore), **kw)


def _scheduler(**kw) -> Scheduler:
    settings = dict(max_queue_size=4, max_prefill_batch=2, prefill_chunk=32, min_prompt_bucket=16,
                    max_model_len=256, shrink_after=2, num_draft_tokens=3)
    return Scheduler(kw.pop("max_batch_size", 4), **(settings | kw))


def test_serve_engine_still_exports_every_name_other_modules_import():
    from peagle_jax.serve import engine, output, requests, scheduler

    assert engine.GenRequest is requests.GenRequest and engine.QueueFull is requests.QueueFull
    assert engine.Delta is output.Delta and engine.Finished is output.Finished and engine.Failed is output.Failed
    assert engine.prefill_shapes is scheduler.prefill_shapes and engine.batch_buckets is scheduler.batch_buckets
    assert all(hasattr(engine, name) for name in engine.__all__)
    assert {"Engine", "EngineStopped", "check_prefill_chunk"} <= set(engine.__all__)


# --------------------------------------------------------------------------- scheduler


def test_group_pairs_short_prompts_within_the_chunk_and_sends_long_ones_alone():
    s = _scheduler()
    a, b, c, d, e = _req(10), _req(12), _req(40), _req(5), _req(20)
    jobs = s.group([a, b, c, d, e])
    # c is longer than the chunk: a job of its own at once (its chunks start while the short ones
    # gather); a+b: 2 rows x 16 = 32 <= chunk, a third would pass max_prefill_batch; d+e: 2 x 24 > 32
    assert [j.reqs for j in jobs] == [[c], [a, b], [d], [e]]
    assert all(j.context is None and j.written == 0 for j in jobs)
    three = _scheduler(max_prefill_batch=3, prefill_chunk=64)
    x, y, z = _req(3), _req(3), _req(3)
    assert [j.reqs for j in three.group([x, y, z])] == [[x, y, z]]  # 4 padded rows x 16 = 64
    assert [j.reqs for j in _scheduler(max_prefill_batch=1).group([x, y])] == [[x], [y]]


def test_admission_fills_free_rows_in_order_and_hands_back_cancelled_requests():
    s = _scheduler(max_batch_size=2)
    reqs = [_req(4) for _ in range(4)]
    reqs[0].cancelled = True
    s.waiting.extend(reqs)
    assert s.room() == 4 + 2 - 4
    cancelled = s.admit()
    assert cancelled == [reqs[0]]
    assert s.prefilling_requests() == reqs[1:3] and list(s.waiting) == [reqs[3]]
    assert s.num_free_slots() == 0 and s.admit() == [] and list(s.waiting) == [reqs[3]]
    assert s.stats() == {"active": 0, "prefilling": 2, "waiting": 1, "slots": 2, "rows": 1}
    assert s.has_work()
    reqs[2].cancelled = True
    assert s.drop_cancelled_prefills() == [reqs[2]] and s.prefilling_requests() == [reqs[1]]
    assert s.in_flight() == [reqs[3], reqs[1]]
    assert s.drain() == [reqs[3], reqs[1]] and not s.has_work()


def test_rows_grow_to_the_bucket_that_holds_the_batch_and_shrink_after_a_while():
    s = _scheduler(max_batch_size=6)
    assert s.buckets == (1, 2, 4, 6)
    a, b, c = _req(), _req(), _req()
    assert s.rows_for(1) == 1 and s.rows_for(3) == 4 and s.rows_for(6) == 6
    order = s.resize_plan(s.rows_for(3))
    assert order == []  # nothing live: a fresh empty batch
    s.apply_resize(4, order)
    slots = s.place([a, b, c], 4)  # 3 requests in a 4-row prefill: the padding row is dropped
    assert slots.tolist() == [0, 1, 2, 4] and (a.slot, b.slot, c.slot) == (0, 1, 2)
    assert s.num_active() == 3 and s.num_free_slots() == 3
    assert s.resize_plan(4) is None and s.resize_plan(2) is None  # same size; 3 do not fit in 2
    assert s.resize_plan(6) == [0, 1, 2, 3]  # growing keeps every row in place
    s.free([0, 2])  # a and c end: b alone in row 1
    assert s.shrink_to() is None  # b fits 2 rows: first round of `shrink_after` (2)
    assert s.shrink_to() == 2
    order = s.resize_plan(2)
    assert order == [1, 0]  # the live row first, padded with a free one
    s.apply_resize(2, order)
    assert s.slots == [b, None] and b.slot == 0 and s.small_rounds == 0
    assert s.shrink_to() is None and s.shrink_to() == 1
    s.place([_req()], 1)  # a second sequence: 2 live rows do not fit 1, the count restarts
    assert s.shrink_to() is None and s.small_rounds == 0
    s.free([0, 1])
    assert s.shrink_to() == 1  # none left: straight to the smallest bucket


def test_a_round_speculates_unless_no_row_may_take_drafts_and_asks_the_policy():
    s = _scheduler()
    off, capped = _req(num_speculative_tokens=0), _req(num_speculative_tokens=1)
    s.place([off], 1)
    assert s.draft_cap(off) == 0 and s.draft_cap(_req()) == 3 and s.draft_cap(capped) == 1
    assert s.speculate(True) == (False, False)
    assert s.speculate(True, AdaptivePolicy()) == (False, False)  # nothing to draft: no question asked
    s.apply_resize(2, [0])
    s.place([capped], 2)
    assert s.speculate(True) == (True, False)
    policy = AdaptivePolicy()
    policy.observe_round(2, True, True, 1.0)  # speculating costs 100x a plain round here
    policy.observe_round(2, False, True, 0.01)
    assert s.speculate(True, policy) == (False, True)
    seeded = _req(temperature=0.7, seed=1)
    s.apply_resize(4, [0, 1])
    s.place([seeded], 4)
    assert s.speculate(False, policy) == (True, False)  # a seeded sampled row pins the round


@pytest.mark.parametrize(("field", "value", "match"), [
    ("prompt_ids", [], "prompt has 0 tokens"), ("prompt_ids", [1] * 256, "prompt has 256"),
    ("prompt_ids", [1, 64], r"outside \[0, 64\)"), ("max_new_tokens", 0, "max_new_tokens"),
    ("max_new_tokens", 253, "max_new_tokens 253 must be in 1..252"), ("temperature", float("nan"), "temperature"),
    ("temperature", 101.0, "temperature"), ("top_k", 2**31, "top_k"), ("top_p", 0.0, "top_p"),
    ("num_speculative_tokens", 4, "num_speculative_tokens 4 must be in 0..3"),
])
def test_check_request_names_the_value_the_batch_cannot_hold(field, value, match):
    r = _req(4)
    check_request(r, max_model_len=256, vocab_size=64, num_draft_tokens=3, method="peagle")
    setattr(r, field, value)
    with pytest.raises(ValueError, match=match):
        check_request(r, max_model_len=256, vocab_size=64, num_draft_tokens=3, method="peagle")


# --------------------------------------------------------------------------- output processor


class _CharTokenizer:
    """Token i is character i of ALPHABET; id 99 decodes to U+FFFD (a character cut in two)."""

    ALPHABET = "abcdefghijklmnopqrstuvwxyz .!"

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\ufffd" if i == 99 else self.ALPHABET[i] for i in ids)


def _ids(text: str) -> list[int]:
    return [_CharTokenizer.ALPHABET.index(ch) for ch in text]


def _output():
    metrics = Metrics(3, 4)
    return OutputProcessor(_CharTokenizer(), metrics), metrics


def _recording(**kw):
    events: list = []
    return _req(3, sink=events.append, **kw), events


def test_emit_streams_text_and_records_the_tokens():
    out, metrics = _output()
    r, events = _recording()
    out.first_tokens([r], 3)
    assert r.first_token_time is not None
    assert not out.emit(r, _ids("ab"))
    assert not out.emit(r, [99])  # held back: an incomplete character is never streamed
    assert not out.emit(r, _ids("c"))
    assert events == [Delta("ab", 2), Delta("\ufffdc", 1)]
    assert r.output_ids == _ids("ab") + [99] + _ids("c") and r.completion_tokens == 4
    assert metrics.generation_tokens._value.get() == 4 and metrics.prompt_tokens._value.get() == 3
    out.finish(r, end_reason(r, hit_eos=True))
    assert events[-1] == Finished("stop", 3, 4, "", 0, 0)
    assert metrics.requests.labels(finish_reason="stop")._value.get() == 1


def test_a_stop_string_cuts_the_text_and_the_tokens_after_it():
    out, _ = _output()
    r, events = _recording(stop=["o w"])
    assert not out.emit(r, _ids("hell"))
    assert out.emit(r, _ids("o world"))  # hit: tokens past the stop string are not counted
    assert r.completion_tokens == 7 and r.output_ids == _ids("hello w")
    out.finish(r, end_reason(r, hit_eos=False))  # a stop string hit ends as "stop", not "length"
    assert "".join(e.text for e in events) == "hell" and events[-1].reason == "stop"


def test_finish_releases_held_back_text_and_a_stop_string_found_at_the_end():
    out, _ = _output()
    r, events = _recording(stop=["xyz"])
    out.emit(r, _ids("ab x"))  # "x" might begin the stop string: held back
    assert events == [Delta("ab ", 4)]
    out.finish(r, "length")
    assert events[-1].text == "x" and events[-1].reason == "length"
    r, events = _recording(stop=["c\ufffd"])
    out.emit(r, _ids("abc") + [99])  # the stop string is completed by the text `flush` releases
    out.finish(r, "length")
    assert events[-1].reason == "stop" and "".join(e.text for e in events) == "ab"


def test_every_request_ends_exactly_once_whoever_ends_it():
    out, metrics = _output()
    r, events = _recording()
    out.emit(r, _ids("hi"))
    out.finish(r, "abort")  # an abort releases nothing more
    out.finish(r, "length")
    out.fail(r, "late")
    assert [type(e) for e in events] == [Delta, Finished] and events[-1].reason == "abort"
    r, events = _recording()
    out.fail(r, "boom")
    out.finish(r, "abort")
    assert events == [Failed("boom")]
    assert metrics.requests.labels(finish_reason="error")._value.get() == 1
    assert metrics.requests.labels(finish_reason="abort")._value.get() == 1


def test_add_round_counts_accepted_drafts_and_target_forwards():
    out, metrics = _output()
    r, events = _recording()
    assert not out.add_round(r, _ids("abc"), 2, True)
    assert not out.add_round(r, _ids("d"), 0, False)  # a plain round: no speculative round counted
    assert (r.accepted_tokens, r.target_forwards, r.spec_rounds, r.completion_tokens) == (2, 2, 1, 4)
    assert metrics.rounds._value.get() == 2
    assert metrics.accepted.labels(position="2")._value.get() == 1
    assert metrics.accepted.labels(position="3")._value.get() == 0
    out.finish(r, "length")
    assert events[-1] == Finished("length", 3, 4, "", 2, 2)


# --------------------------------------------------------------------------- step runner

K = 2
MAX_LEN = 64


def _runner(target, drafter, method="peagle", **kw):
    from peagle_jax.serve.runner import Runner

    return Runner(target, drafter, [], method=method, num_draft_tokens=K if method != "none" else 0,
                  max_model_len=MAX_LEN, seed=0, min_prompt_bucket=16, **kw)


def _start(runner, rows: int, reqs) -> list[list[int]]:
    """Prefill `reqs` into rows 0.. of an empty `rows`-row batch; their first tokens."""
    runner.reset(rows)
    new, _, first, _, _ = runner.prefill_rows(reqs)
    slots = np.full((new.last_token.shape[0],), rows, np.int32)  # padding rows: out of range, dropped
    slots[: len(reqs)] = np.arange(len(reqs))
    runner.insert(new, slots)
    return [[int(first[i])] for i in range(len(reqs))]


def _round(runner, tokens: list[list[int]], rows: list[int], greedy: bool = True):
    """One round; appends the new tokens of request i (in batch row rows[i]); returns `done`."""
    toks, counts, done, _, _ = runner.round(greedy)
    for out, s in zip(tokens, rows, strict=True):
        out += toks[s, : counts[s]].tolist()
    return done


@pytest.fixture(scope="module")
def reference(tiny_target, tiny_head):
    from peagle_jax.generate import speculative_generate

    prompts = [[5, 9, 3, 17, 22], [40, 2, 8]]
    out = speculative_generate(tiny_target, tiny_head, prompts, method="peagle", num_draft_tokens=K,
                               max_new_tokens=12)
    return prompts, [list(t) for t in out.tokens]


@pytest.fixture(scope="module")
def runner(tiny_target, tiny_head):
    """One runner for the tests below (each starts from an empty batch): its programs compile once."""
    return _runner(tiny_target, tiny_head)


def _greedy(prompts):
    return [GenRequest(p, 12, _ignore, temperature=0.0) for p in prompts]


def test_runner_rounds_give_speculative_generates_tokens(runner, reference):
    prompts, ref = reference
    tokens = _start(runner, 2, _greedy(prompts))
    while not _round(runner, tokens, [0, 1]).all():
        pass
    assert tokens == ref
    tokens = _start(runner, 4, _greedy(prompts[1:]))  # alone in 4 rows (its prefill's padding row dropped)
    while not _round(runner, tokens, [0])[0]:
        pass
    assert tokens == ref[1:]


def test_resizes_and_finished_rows_leave_the_other_rows_outputs_alone(runner, reference):
    prompts, ref = reference
    tokens = _start(runner, 2, _greedy(prompts))
    _round(runner, tokens, [0, 1])
    runner.resize(4, [0, 1])  # growing: every row in place
    _round(runner, tokens, [0, 1])
    runner.finish_rows([0], 4)  # request 0 ends early (a cancel, a stop string)
    done = _round(runner, tokens, [0, 1])
    assert done[0] and not done[1]
    runner.resize(1, [1])  # compacted: request 1 alone in row 0
    while not _round(runner, tokens[1:], [0])[0]:
        pass
    assert tokens[1] == ref[1]
    assert tokens[0] == ref[0][: len(tokens[0])] and len(tokens[0]) < len(ref[0])


def test_seeded_sampling_does_not_depend_on_batch_mates(runner):

    def first_tokens(reqs):
        return runner.prefill_rows(reqs)[2][: len(reqs)].tolist()

    seeded = dict(temperature=1.0, seed=1234)
    alone = first_tokens([GenRequest([3, 4, 5], 4, _ignore, **seeded)])
    together = first_tokens([GenRequest([7, 7], 4, _ignore, temperature=1.0),
                             GenRequest([3, 4, 5], 4, _ignore, **seeded)])
    assert together[1] == alone[0]


def test_warmup_compiles_every_program_requests_meet_and_times_each_round(tiny_target):
    from peagle_jax.serve import programs as mod
    from peagle_jax.serve.scheduler import prefill_shapes

    policy = AdaptivePolicy()
    runner = _runner(tiny_target, None, method="none", policy=policy)
    shapes = prefill_shapes(2, 32, 16, MAX_LEN - 1)
    runner.warmup((1, 2), shapes, 32)
    assert set(policy.cost_table()) == {(b, s, g) for b in (1, 2) for s in (True, False) for g in (True, False)}

    def compiled():
        fns = {k: v for k, v in vars(runner.programs).items() if k != "weights"}
        fns |= {n: getattr(mod, n) for n in ("insert_jit", "finish_jit", "take_jit", "keys_from_seeds")}
        return {name: fn._cache_size() for name, fn in fns.items()}

    before = compiled()
    long_prompt = list(range(1, 41))  # a 32-token chunk, then an 8-token tail
    runner.reset(1)
    context = runner.chunk(None, long_prompt, 0, 32)
    new, *_ = runner.prefill_rows([GenRequest(long_prompt, 4, _ignore, temperature=0.0)], context, 32)
    runner.insert(new, np.zeros((1,), np.int32))
    runner.resize(2, [0])
    new, *_ = runner.prefill_rows([GenRequest([1, 2], 4, _ignore, temperature=0.5), GenRequest([3], 4, _ignore)])
    runner.insert(new, np.array([1, 2], np.int32))  # into a 2-row batch: the second is dropped
    jax.block_until_ready(runner.round(False))
    runner.finish_rows([0], 2)
    runner.resize(1, [1])
    jax.block_until_ready(runner.round(True))
    assert compiled() == before


def test_warmup_plan_makes_the_smallest_batch_ready_first_and_names_the_rest(tiny_target):
    # The server says ready after the first plan (one-row prefills of short prompts, the smallest
    # bucket's programs); the rest compiles in the background, and `Engine.compiling` names it.
    from peagle_jax.serve.runner import run_waves
    from peagle_jax.serve.scheduler import prefill_shapes

    runner = _runner(tiny_target, None, method="none")
    shapes = prefill_shapes(2, 64, 16, MAX_LEN - 1)
    first, rest = runner.warmup_plan((1, 2), shapes, 64, first_prompt_bucket=32)
    names = [[name for name, _ in wave] for wave in first]
    assert names == [["prefill 1x16", "prefill 1x24", "prefill 1x32", "greedy round at 1 rows",
                      "sampled round at 1 rows", "row moves at 1 rows"]]
    left = [name for wave in rest for name, _ in wave]
    assert left == ["prefill 1x48", "prefill 1x64", "prefill 2x16", "prefill 2x24", "prefill 2x32",
                    "prompt chunk 64", "greedy round at 2 rows", "sampled round at 2 rows", "row moves at 2 rows"]
    # run_waves: waves in order, each reported done once all its jobs have run
    ran, done = [], []
    waves = [[("a", lambda: ran.append("a")), ("b", lambda: ran.append("b"))], [("c", lambda: ran.append("c"))]]
    run_waves(waves, lambda name: done.append((name, len(ran))))
    assert sorted(ran[:2]) == ["a", "b"] and ran[2] == "c"
    assert done == [("a", 2), ("b", 2), ("c", 3)]

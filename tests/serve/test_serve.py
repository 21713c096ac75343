"""The OpenAI-compatible server, end to end: a real uvicorn server on a loopback port, driven
with the official `openai` client (and httpx for raw SSE / bad bodies).

A tiny random llama target (vocab 49152, hidden 32) and a random P-EAGLE drafter keep compiles
short while the real SmolLM2 tokenizer gives real text round trips (including multi-byte UTF-8
characters split across tokens, which random models produce plenty of).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import openai
import pytest
from conftest import tiny_target_with_real_tokenizer

from peagle_jax.api import chat_ids
from peagle_jax.generate import speculative_generate
from peagle_jax.serve import ServeConfig, create_app
from peagle_jax.serve.testing import free_port, serve_in_thread

K = 3
MAX_LEN = 256
KEY = "test-key"
MODEL = "tiny-peagle"


def _tiny_models():
    from peagle_jax.drafters import DrafterConfig, create_drafter

    target, tok, eos = tiny_target_with_real_tokenizer(layers=4, seed=1)
    dcfg = DrafterConfig.for_target(target.config, num_layers=1, parallel_drafting=True, mask_token_id=49151)
    return target, create_drafter(dcfg, seed=2), tok, eos


@pytest.fixture(scope="module")
def models():
    return _tiny_models()


@pytest.fixture(scope="module")
def server(models):
    target, drafter, tok, eos = models
    # No warm-up: each test compiles only the programs it meets (the warm-up itself is
    # tests/serve/test_serve_engine_parts.py's); prefill_chunk 64 keeps those to 9 prefill shapes.
    config = ServeConfig(max_batch_size=4, max_model_len=MAX_LEN, num_draft_tokens=K, api_key=KEY,
                         max_queue_size=64, prefill_chunk=64, served_model_name=MODEL, warmup=False)
    app = create_app(config, target=target, drafter=drafter, tokenizer=tok, eos_ids=eos)
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


def _reference(models, prompt_ids: list[list[int]], max_tokens: int) -> list[str]:
    target, drafter, tok, eos = models
    out = speculative_generate(target, drafter, prompt_ids, method="peagle", num_draft_tokens=K,
                               max_new_tokens=max_tokens, eos_token_ids=eos)
    return [tok.decode(t, skip_special_tokens=True) for t in out.tokens], out


def _chat_ids(tok, text):
    return chat_ids(tok, text)


def _wait_idle(url, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(url + "/health").json()
        if h["active"] == 0 and h["waiting"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError(f"server not idle: {h}")


# --------------------------------------------------------------------------- basics


def test_models_health_metrics(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    h = httpx.get(server + "/health").json()
    assert h["status"] == "ok" and h["method"] == "peagle" and h["slots"] == 4
    assert h["compiling"] == []  # no warm-up here, so nothing compiles in the background
    text = httpx.get(server + "/metrics").text
    for name in ("peagle_queue_depth", "peagle_batch_occupancy", "peagle_time_to_first_token_seconds_bucket",
                 "peagle_time_per_output_token_seconds_bucket", "peagle_acceptance_length_bucket",
                 'peagle_draft_accepted_total{position="3"}', "peagle_prompt_tokens_total"):
        assert name in text


def test_greedy_completion_and_chat_equal_speculative_generate(models, client):
    tok = models[2]
    prompt = "The capital of France is"
    ref, out = _reference(models, [tok.encode(prompt)], 24)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref[0]
    assert r.choices[0].finish_reason == out.finish_reasons[0]
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    assert r.usage.completion_tokens == len(out.tokens[0])
    # per-request speculation statistics, through the official client (an extension field)
    spec = r.usage.model_extra["speculation"]
    assert spec["method"] == "peagle" and spec["num_draft_tokens"] == K
    assert spec["target_forwards"] == int(out.rounds[0])
    assert spec["accepted_tokens"] == int(out.accepted_per_sequence[0].sum())
    assert spec["acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["target_forwards"], abs=1e-4)

    msg = "Write a haiku about the sea."
    ref, out = _reference(models, [_chat_ids(tok, msg)], 20)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": msg}],
                                       max_tokens=20, temperature=0)
    assert r.choices[0].message.content == ref[0]
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(_chat_ids(tok, msg))


def test_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.model_extra["speculation"] == full.usage.model_extra["speculation"]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    # No delta ever carries half a character (random models emit plenty of multi-byte tokens).
    assert all("\ufffd" not in (c.choices[0].text if c.choices else "") for c in chunks) or "\ufffd" in text

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=25, temperature=0)
    full = client.chat.completions.create(**chat)
    chunks = list(client.chat.completions.create(stream=True, **chat))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_raw_sse_ends_with_done(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=_auth(), timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_stop_strings_are_removed(models, client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    words = [w for w in full.split(" ") if len(w) >= 3]
    stop = words[len(words) // 2]
    expect = full[: full.index(stop)]
    r = client.completions.create(stop=[stop, "\u2603never\u2603"], **kw)
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 30
    chunks = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == expect
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_params_and_seed(client):
    kw = dict(model=MODEL, prompt="Sampling test", max_tokens=12)
    a = client.completions.create(temperature=0.8, top_p=0.9, seed=7, extra_body={"top_k": 50}, **kw)
    assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 12
    # top_k=1 is greedy whatever the temperature.
    g = client.completions.create(temperature=0, **kw).choices[0].text
    assert client.completions.create(temperature=1.5, extra_body={"top_k": 1}, **kw).choices[0].text == g
    # n choices and a prompt list.
    r = client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=4, temperature=0, n=2)
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text


def test_seed_reproducible_whatever_shares_the_batch(client):
    """Per-sequence PRNG keys: a seeded request's samples do not depend on its batch mates."""
    import concurrent.futures

    kw = dict(model=MODEL, prompt="Seeded sampling", max_tokens=10, temperature=1.0)
    alone = client.completions.create(seed=1234, **kw).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(client.completions.create, seed=s, **kw) for s in (1, 2, 3)]
        again = pool.submit(client.completions.create, seed=1234, **kw)
        texts = [f.result().choices[0].text for f in others]
    assert again.result().choices[0].text == alone
    assert len(set(texts + [alone])) > 1  # different seeds really sample differently


# Slow: 50-60 s of sampled rounds over a 49k vocabulary at the fast suite's optimization level;
# the fast suite's cover is test_seed_reproducible_whatever_shares_the_batch.
@pytest.mark.slow
@pytest.mark.parametrize("limit", [None, 0])
def test_seeded_chat_holds_beside_greedy_neighbours(client, limit):
    """A seeded sampled chat request gives the same text alone and beside 1, 3 and 7 greedy
    neighbours, with its drafts on or off (`num_speculative_tokens` 0): the neighbours change
    the round's verify width and whether the round speculates, never the request's draws."""
    import concurrent.futures

    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    seeded = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0.8, top_p=0.95, seed=777)
    greedy = dict(model=MODEL, max_tokens=16, temperature=0)

    def run(neighbours: int, limit: int | None) -> str:
        extra = {} if limit is None else {"extra_body": {"num_speculative_tokens": limit}}
        with concurrent.futures.ThreadPoolExecutor(neighbours + 1) as pool:
            others = [pool.submit(client.chat.completions.create,
                                  messages=[{"role": "user", "content": f"Count to {i + 5}, please."}], **greedy)
                      for i in range(neighbours)]
            mine = pool.submit(client.chat.completions.create, **seeded, **extra)
            for f in others:
                f.result()
            return mine.result().choices[0].message.content

    alone = run(0, limit)
    for neighbours in (1, 3, 7):
        assert run(neighbours, limit) == alone, neighbours


# --------------------------------------------------------------------------- load


# Slow: 16 budgets compile and run most of the server's programs (15-25 s); the fast suite's
# cover of a growing and compacting batch is tests/serve/test_serve_buckets.py.
@pytest.mark.slow
def test_sixteen_concurrent_requests(models, server, client):
    tok = models[2]
    prompts = [f"Request number {i}: tell me about item {i * 7}" for i in range(16)]
    budgets = [8 + (i * 5) % 23 for i in range(16)]
    # Greedy output under a smaller budget is a prefix of the output under a larger one.
    out = speculative_generate(models[0], models[1], [tok.encode(p) for p in prompts], method="peagle",
                               num_draft_tokens=K, max_new_tokens=max(budgets), eos_token_ids=models[3])
    refs = {i: tok.decode(out.tokens[i][: budgets[i]], skip_special_tokens=True) for i in range(16)}

    def one(i):
        kw = dict(model=MODEL, prompt=prompts[i], max_tokens=budgets[i])
        if i % 4 == 3:  # sampled requests share the batch with greedy ones
            r = client.completions.create(temperature=0.9, **kw)
            return i, None, r.usage.completion_tokens
        if i % 2:
            chunks = list(client.completions.create(temperature=0, stream=True, **kw))
            return i, "".join(c.choices[0].text for c in chunks), None
        return i, client.completions.create(temperature=0, **kw).choices[0].text, None

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    for i, text, n in results:
        if text is None:
            assert 1 <= n <= budgets[i]
        else:
            assert text == refs[i], i
    _wait_idle(server)
    m = httpx.get(server + "/metrics").text
    assert "peagle_batch_occupancy 0.0" in m


def test_disconnect_mid_stream_frees_the_slot(server, client):
    body = {"model": MODEL, "prompt": "Keep talking", "max_tokens": 200, "temperature": 0, "stream": True}
    for _ in range(5):  # more disconnects than the batch has slots
        with httpx.stream("POST", server + "/v1/completions", json=body, headers=_auth(), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # close after the first event
    h = _wait_idle(server)
    assert h["active"] == 0
    m = httpx.get(server + "/metrics").text
    assert 'peagle_requests_total{finish_reason="abort"}' in m
    r = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("body,param", [
    (b'{"model": "tiny-peagle", "prompt": ', None),
    (b'[1, 2]', None),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "12"}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": 5}, "prompt"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": "word " * (MAX_LEN + 10)}, "prompt"),
    ({"model": MODEL, "prompt": "hello", "max_tokens": MAX_LEN}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "top_k": 2147483648}, "top_k"),  # past int32: used to fail the batch
    ({"model": MODEL, "prompt": "x", "temperature": 1e39}, "temperature"),
    (b'{"model": "tiny-peagle", "prompt": "abc \\ud800 def"}', "prompt"),  # lone surrogate: used to be a 500
    ({"model": MODEL, "prompt": "x", "stop": [""]}, "stop"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": MODEL, "prompt": [1, 99999999]}, "prompt"),
])
def test_bad_completion_requests_get_400(server, body, param):
    kw = {"content": body, "headers": {**_auth(), "content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": _auth()}
    r = httpx.post(server + "/v1/completions", timeout=30, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    assert set(err) == {"message", "type", "param", "code"}


def test_unknown_model_is_404_as_in_openai(server):
    r = httpx.post(server + "/v1/completions", json={"model": "gpt-4", "prompt": "x"}, headers=_auth(), timeout=30)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found"


def test_head_health_and_usage_counts_the_prompt_once(server):
    assert httpx.head(server + "/health", timeout=30).status_code == 200
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2, "temperature": 0}
    one = httpx.post(server + "/v1/completions", json=body, headers=_auth(), timeout=60).json()["usage"]
    three = httpx.post(server + "/v1/completions", json={**body, "n": 3}, headers=_auth(), timeout=60).json()["usage"]
    assert three["prompt_tokens"] == one["prompt_tokens"]  # OpenAI / vLLM: not multiplied by n
    assert three["completion_tokens"] == 3 * one["completion_tokens"]


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.role"),
    ({"model": MODEL, "messages": "hello"}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi " * MAX_LEN}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
])
def test_bad_chat_requests_get_400(server, client, body, param):
    r = httpx.post(server + "/v1/chat/completions", json=body, headers=_auth(), timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    # the openai client surfaces it as BadRequestError, and the server keeps serving
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server + "/health").status_code == 200  # health and metrics stay open


def test_queue_full_gives_429(models):
    target, drafter, tok, eos = models
    config = ServeConfig(max_batch_size=1, max_model_len=MAX_LEN, num_draft_tokens=K, max_queue_size=0,
                         warmup=False, served_model_name=MODEL)
    app = create_app(config, target=target, drafter=drafter, tokenizer=tok, eos_ids=eos)
    with serve_in_thread(app) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        stream = c.completions.create(model=MODEL, prompt="long one", max_tokens=200, temperature=0, stream=True)
        first = next(iter(stream))  # the only slot is now busy
        assert first.choices
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=MODEL, prompt="second", max_tokens=5)
        assert e.value.status_code == 429
        assert e.value.body["code"] == "rate_limit_exceeded"
        rest = list(stream)
        assert rest[-1].choices[0].finish_reason == "length"
        _wait_idle(url)
        assert c.completions.create(model=MODEL, prompt="now", max_tokens=3).usage.completion_tokens == 3


_SIGTERM_SERVER = textwrap.dedent("""
    import sys
    sys.path[:0] = [{tests!r}, {tests_root!r}]  # test_serve.py's folder, and tests/ for its conftest
    from test_serve import _tiny_models
    from peagle_jax.serve import ServeConfig, create_app, run
    target, drafter, tok, eos = _tiny_models()
    config = ServeConfig(port={port}, max_batch_size=2, max_model_len=512, num_draft_tokens=3,
                         warmup=False, drain_timeout={drain}, served_model_name="tiny-peagle")
    app = create_app(config, target=target, drafter=drafter, tokenizer=tok, eos_ids=eos)
    real_round = app.state.engine.runner.round
    def slow_round(greedy, speculate=True):  # 20 ms a round: a 480-token stream lasts seconds, past a 0 s drain
        import time
        time.sleep(0.02)
        return real_round(greedy, speculate)
    app.state.engine.runner.round = slow_round
    run(app, config)
""")


# Slow: a second Python process that builds and compiles its own server (30-40 s).
@pytest.mark.slow
@pytest.mark.parametrize("drain,max_tokens,reason", [(60, 100, "length"), (0, 480, "abort")])
def test_sigterm_drains_then_ends_every_stream_and_exits_0(drain, max_tokens, reason):
    # Within the drain time a stream runs to its end; past it, it still ends properly: a last
    # chunk with finish_reason "abort" and [DONE], never a cut connection. Exit status 0 both ways.
    port = free_port()
    script = _SIGTERM_SERVER.format(tests=os.path.dirname(__file__),
                                    tests_root=os.path.dirname(os.path.dirname(__file__)), port=port, drain=drain)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]
            time.sleep(0.3)
        body = {"model": MODEL, "prompt": "drain me", "max_tokens": max_tokens, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=240) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == reason
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read().decode()
        assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "peagle+ngram/2c"])
def test_context_drafter_server_equals_plain_decoding(models, method):
    # Through the server's slot engine, greedy completions are exactly plain decoding's with
    # prompt lookup alone, and with P-EAGLE + prompt lookup verifying both chains in one
    # forward (greedy program; a sampled request then runs the sampled program, one chain).
    from peagle_jax.drafters.hybrid import HybridProposer
    from peagle_jax.drafters.ngram import NgramProposer

    target, head, tok, eos = models
    drafter = NgramProposer(1, 3)
    if method != "ngram":
        drafter = HybridProposer(head, drafter, head_draft_tokens=1, two_chains=True)
    config = ServeConfig(max_batch_size=2, max_model_len=MAX_LEN, num_draft_tokens=K, warmup=False,
                         served_model_name=MODEL)
    app = create_app(config, target=target, drafter=drafter, tokenizer=tok, eos_ids=eos)
    prompts = ["the the the the the", "a b c a b c a b"]
    ref = speculative_generate(target, None, [tok.encode(p) for p in prompts], method="none", max_new_tokens=24,
                               eos_token_ids=eos)
    with serve_in_thread(app) as url:
        assert httpx.get(url + "/health").json()["method"] == method.removesuffix("/2c")
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for p, want in zip(prompts, ref.tokens, strict=True):
            got = c.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text
            assert got == tok.decode(want, skip_special_tokens=True)
        sampled = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0.8, seed=1)
        assert sampled.usage.completion_tokens == 8


@pytest.mark.parametrize("k", [0, 1])
def test_per_request_speculation_setting(models, client, k):
    # extra_body num_speculative_tokens: the same greedy text; at most k drafts accepted per round
    # (0: one token per target forward, as without speculation).
    tok = models[2]
    prompt = "Per-request speculation"
    ref, out = _reference(models, [tok.encode(prompt)], 20)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                  extra_body={"num_speculative_tokens": k})
    assert r.choices[0].text == ref[0]
    spec = r.usage.model_extra["speculation"]
    assert spec["num_draft_tokens"] == k and spec["accepted_tokens"] <= k * spec["target_forwards"]
    if k == 0:
        assert spec["accepted_tokens"] == 0 and spec["target_forwards"] == r.usage.completion_tokens - 1
    with pytest.raises(openai.BadRequestError, match="num_speculative_tokens"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                  extra_body={"num_speculative_tokens": K + 1})

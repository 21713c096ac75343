"""A fuzz replay and a 60 s soak of the live server (slow suite; #14).

The fuzz list sends malformed and out-of-range requests to both endpoints: every one must get
a 4xx with an OpenAI error body naming the problem, never a 5xx. The soak runs 16 concurrent
clients for 60 s mixing greedy streams, sampled and seeded requests, n > 1 and prompt lists,
bad requests and clients that disconnect mid-request; it passes with 0 5xx answers, 0 truncated
streams and, at the end, every slot and the queue empty (through /health and /metrics).
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import time

import httpx
import openai
import pytest
from test_serve import MAX_LEN, MODEL, _tiny_models

from peagle_jax.serve import ServeConfig, create_app
from peagle_jax.serve.testing import serve_in_thread

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
_MSG = [{"role": "user", "content": "hi"}]


def _fuzz_cases() -> list[tuple[str, object]]:
    """(path, body) pairs that must all be refused with a 4xx. Bytes are sent raw."""
    bad_values = {
        "max_tokens": [0, -1, "8", 1.5, True, [4], 10**12, MAX_LEN * 4],
        "temperature": [-1, "hot", 1e39, 101, [0.5], {"t": 1}],
        "top_p": [0, -0.1, 1.5, "0.9", [1]],
        "top_k": [-2, 2**31, 2**63, "5", 1.5],
        "n": [0, -1, 17, 1000, "2", 1.0],
        "seed": ["seed", 1.5, [1]],
        "stop": ["", [""], [1, 2], 5, {"a": 1}],
        "stream": ["yes", 1, [True]],
        "stream_options": ["x", 5],
        "model": [5, ["a"], "no-such-model"],
        "presence_penalty": [1.0, -2], "frequency_penalty": [0.5],
        "logprobs": [True, 5], "tools": [[{"type": "function"}]], "tool_choice": ["required"],
        "response_format": [{"type": "json_object"}], "logit_bias": [{"1": 5}], "best_of": [3],
        "min_tokens": [4], "ignore_eos": [True], "repetition_penalty": [1.3], "stop_token_ids": [[1]],
    }
    cases: list[tuple[str, object]] = []
    for field, values in bad_values.items():
        for v in values:
            cases.append((COMPLETIONS, {"model": MODEL, "prompt": "x", field: v}))
            cases.append((CHAT, {"model": MODEL, "messages": _MSG, field: v}))
    cases += [(COMPLETIONS, {"model": MODEL, "prompt": p}) for p in
              (5, "", [], [[1, 2]], [1, -1], [1, 10**9], [1, 2**40], {"text": "x"}, None, "w " * (MAX_LEN + 8))]
    cases += [(COMPLETIONS, {"model": MODEL, "prompt": "x", "echo": True}),
              (COMPLETIONS, {"model": MODEL, "prompt": "x", "suffix": "y"}),
              (COMPLETIONS, {"model": MODEL})]
    cases += [(CHAT, {"model": MODEL, "messages": m}) for m in
              ([], None, "hi", [{"role": "wizard", "content": "x"}], [{"content": "x"}],
               [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url", "x": 1}]}],
               [{"role": "user", "content": "w " * (MAX_LEN + 8)}])]
    cases += [(CHAT, {"model": MODEL, "messages": _MSG, "max_completion_tokens": 0})]
    raw = [b'{"model": "tiny-peagle", "prompt": "abc \\ud800 def"}',  # a lone surrogate, as JSON allows
           b'{"model": "tiny-peagle", "messages": [{"role": "user", "content": "\\udfff"}]}',
           b"", b"{", b"[]", b"null", b"42", b'"text"', b'{"prompt": "x"', b"\xff\xfe", b'{"model": 1e400}',
           b'{"model": "tiny-peagle", "prompt": "x", "max_tokens": 1e400}']
    cases += [(path, body) for path in (COMPLETIONS, CHAT) for body in raw]
    return cases


def _post(client: httpx.Client, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"}, **kw)
    return client.post(path, json=body, **kw)


@pytest.fixture(scope="module")
def server():
    target, drafter, tok, eos = _tiny_models()
    # prefill_chunk 64: fewer prefill shapes to warm up, and longer prompts take the chunked path under load
    config = ServeConfig(max_batch_size=8, max_model_len=MAX_LEN, num_draft_tokens=3, max_queue_size=64,
                         prefill_chunk=64, served_model_name=MODEL)
    with serve_in_thread(create_app(config, target=target, drafter=drafter, tokenizer=tok, eos_ids=eos)) as url:
        yield url


def test_fuzz_list_gets_4xx_with_an_error_body(server):
    cases = _fuzz_cases()
    assert len(cases) >= 98
    with httpx.Client(base_url=server, timeout=60) as c:
        for path, body in cases:
            r = _post(c, path, body)
            assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert err["message"] and err["type"], (path, body, err)
    assert httpx.get(server + "/health").json()["active"] == 0


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


def _client_loop(url: str, deadline: float, seed: int) -> dict[str, int]:
    """One soak client: random kinds of requests until the deadline; returns counts, raises on
    a 5xx or a truncated stream."""
    rng = random.Random(seed)
    fuzz = _fuzz_cases()
    counts: dict[str, int] = {}
    oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with httpx.Client(base_url=url, timeout=120) as c:
        while time.monotonic() < deadline:
            kind = rng.choice(["greedy_stream", "sampled", "seeded_n", "prompt_list", "bad", "drop_stream",
                               "drop_wait", "chat_stream"])
            counts[kind] = counts.get(kind, 0) + 1
            prompt = rng.choice(["Once upon a time", "def f(x):", "The capital of", "1, 2, 3,"])
            if kind == "greedy_stream":
                body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(4, 40), "temperature": 0,
                        "stream": True}
                with c.stream("POST", COMPLETIONS, json=body) as r:
                    assert r.status_code in (200, 429), r.status_code
                    if r.status_code == 200:
                        lines = [line for line in r.iter_lines() if line]
                        assert lines[-1] == "data: [DONE]", lines[-3:]
                        last = json.loads(lines[-2][6:])
                        assert last["choices"][0]["finish_reason"] in ("stop", "length"), last
            elif kind == "chat_stream":
                try:
                    messages = [{"role": "user", "content": prompt}]
                    chunks = list(oa.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                             max_tokens=rng.randint(2, 24), temperature=0.7,
                                                             top_p=0.9))
                    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
                except openai.RateLimitError:
                    pass
            elif kind in ("sampled", "seeded_n", "prompt_list"):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(1, 24), "temperature": 0.9,
                        "top_k": rng.choice([0, 5, 50]), "top_p": rng.choice([1.0, 0.8])}
                if kind == "seeded_n":
                    body.update(n=rng.randint(2, 3), seed=rng.randint(0, 99))
                if kind == "prompt_list":
                    body["prompt"] = [prompt, prompt + " again"]
                r = c.post(COMPLETIONS, json=body)
                assert r.status_code in (200, 429), (r.status_code, r.text[:300])
            elif kind == "bad":
                path, body = rng.choice(fuzz)
                r = _post(c, path, body)
                assert 400 <= r.status_code < 500, (path, body, r.status_code)
            elif kind == "drop_stream":  # read one chunk, then hang up
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 100, "temperature": 0, "stream": True}
                with c.stream("POST", COMPLETIONS, json=body) as r:
                    assert r.status_code in (200, 429)
                    next(r.iter_lines(), None)
            else:  # drop_wait: a non-streaming client that gives up
                try:
                    r = c.post(COMPLETIONS, json={"model": MODEL, "prompt": prompt, "max_tokens": 150}, timeout=0.3)
                    assert r.status_code in (200, 429), r.status_code
                except httpx.TimeoutException:
                    pass
    return counts


def test_soak_60s_at_concurrency_16(server):
    deadline = time.monotonic() + 60
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: _client_loop(server, deadline, i), range(16)))
    total: dict[str, int] = {}
    for counts in results:
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    assert all(total.get(k, 0) > 0 for k in ("greedy_stream", "sampled", "bad", "drop_stream", "drop_wait")), total
    # Every slot and the queue drain (the gone clients' included).
    end = time.monotonic() + 30
    while time.monotonic() < end:
        h = httpx.get(server + "/health").json()
        if h["active"] == 0 and h["waiting"] == 0:
            break
        time.sleep(0.1)
    assert h["active"] == 0 and h["waiting"] == 0, h
    assert _metric(server, "peagle_batch_occupancy") == 0
    assert _metric(server, "peagle_queue_depth") == 0
    server_errors = [line for line in httpx.get(server + "/metrics").text.splitlines()
                     if line.startswith("peagle_http_requests_total{") and 'status="5' in line
                     and not line.endswith(" 0.0")]
    assert not server_errors, server_errors

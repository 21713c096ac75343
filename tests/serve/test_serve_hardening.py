"""Server hardening (#14): no request can hurt another, every disconnect frees its slot, limits
before parsing, OpenAI/vLLM defaults. Each test failed on the code before its fix."""

from __future__ import annotations

import collections
import threading
import time

import httpx
import openai
import pytest
from test_serve import MAX_LEN, MODEL, _tiny_models

from peagle_jax.generate import speculative_generate
from peagle_jax.serve import ServeConfig, create_app
from peagle_jax.serve.engine import Engine, Failed, Finished, GenRequest
from peagle_jax.serve.testing import serve_in_thread

K = 3


@pytest.fixture(scope="module")
def models():
    return _tiny_models()


def _app(models, **settings):
    target, drafter, tok, eos = models
    config = ServeConfig(**dict(dict(max_batch_size=2, max_model_len=MAX_LEN, num_draft_tokens=K, warmup=False,
                                     served_model_name=MODEL), **settings))
    return create_app(config, target=target, drafter=drafter, tokenizer=tok, eos_ids=eos)


def _metric(url: str, name: str) -> float:
    """A sample's value (name with its labels); 0 while a labelled counter has no sample yet."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --------------------------------------------------------------------------- one request, one failure


@pytest.mark.slow
def test_poisoned_request_fails_alone_and_neighbours_are_byte_identical(models):
    target, drafter, tok, eos = models
    engine = Engine(target, drafter, tok, eos, method="peagle", num_draft_tokens=K, max_batch_size=4,
                    max_model_len=MAX_LEN, max_prefill_batch=4)
    engine.start(warmup=False)
    events: dict[int, list] = collections.defaultdict(list)
    done = threading.Semaphore(0)

    def request(i, ids, **kw):
        def sink(ev):
            events[i].append(ev)
            if isinstance(ev, Finished | Failed):
                done.release()
        return GenRequest(ids, 12, sink, temperature=0.0, **kw)

    prompts = [tok.encode("first neighbour"), tok.encode("second neighbour, longer prompt")]
    try:
        # Past the door (as if a check were missing), a request that breaks its prefill fails alone;
        # it shares a prefill group with both neighbours.
        bad = request(2, [1, 2, 2**40])
        with engine._cv:
            engine.scheduler.waiting.extend([request(0, prompts[0]), bad, request(1, prompts[1])])
            engine._cv.notify()
        for _ in range(3):
            assert done.acquire(timeout=120)
    finally:
        engine.shutdown()
    assert isinstance(events[2][-1], Failed)
    ref = speculative_generate(target, drafter, prompts, method="peagle", num_draft_tokens=K, max_new_tokens=12,
                               eos_token_ids=eos)
    for i in (0, 1):
        assert isinstance(events[i][-1], Finished)
        text = "".join(ev.text for ev in events[i])
        assert text == tok.decode(ref.tokens[i], skip_special_tokens=True)


@pytest.mark.parametrize("field,value", [("top_k", 2**31), ("temperature", float("inf")), ("top_p", 0.0),
                                         ("prompt_ids", [1, 49152]), ("max_new_tokens", MAX_LEN)])
def test_values_the_batch_cannot_hold_are_refused_at_the_door(models, field, value):
    target, drafter, tok, eos = models
    engine = Engine(target, drafter, tok, eos, method="peagle", num_draft_tokens=K, max_batch_size=2,
                    max_model_len=MAX_LEN)
    engine.started = True  # no thread: only the admission check runs
    req = GenRequest([1, 2, 3], 4, lambda ev: None, temperature=0.0)
    setattr(req, field, value)
    with pytest.raises(ValueError, match=field.split("_ids")[0]):
        engine.submit(req)
    assert engine.stats()["waiting"] == 0


# --------------------------------------------------------------------------- disconnects


def test_non_streaming_disconnect_frees_the_slot_while_tokens_flow(models):
    app = _app(models, max_batch_size=1)
    engine = app.state.engine
    real_round = engine.runner.round

    def slow_round(greedy, speculate=True):  # tokens keep arriving (every 50 ms), so an idle-time check never fires
        time.sleep(0.05)
        return real_round(greedy, speculate)

    engine.runner.round = slow_round
    with serve_in_thread(app) as url:
        body = {"model": MODEL, "prompt": "a long answer", "max_tokens": 2, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=300).status_code == 200  # compiled now
        aborts = _metric(url, 'peagle_requests_total{finish_reason="abort"}')
        body["max_tokens"] = 240  # >= 60 rounds of 50 ms: at least 3 s, mostly many more
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/completions", json=body, timeout=1.0)
        deadline = time.monotonic() + 2.0
        while httpx.get(url + "/health").json()["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(url + "/health").json()["active"] == 0
        assert _metric(url, 'peagle_requests_total{finish_reason="abort"}') == aborts + 1


# --------------------------------------------------------------------------- limits before parsing


def test_body_limit_and_key_checked_before_the_body_is_read(models):
    app = _app(models, max_request_bytes=4096, api_key="k")
    with serve_in_thread(app) as url:
        big = {"model": MODEL, "prompt": "x" * 10_000, "max_tokens": 1}
        r = httpx.post(url + "/v1/completions", json=big, headers={"Authorization": "Bearer k"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit applies while the body streams in
            yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        r = httpx.post(url + "/v1/completions", content=chunks(),
                       headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        # Without the key, even a huge body is answered 401 from its headers alone.
        r = httpx.post(url + "/v1/completions", json={"prompt": "z" * 1_000_000})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 2},
                        headers={"Authorization": "Bearer k"}, timeout=300)
        assert ok.status_code == 200


def test_keyless_server_answers_only_loopback_host_names(models):
    with serve_in_thread(_app(models)) as url:
        port = url.rsplit(":", 1)[1]
        for host, status in ((f"localhost:{port}", 200), (f"127.0.0.1:{port}", 200), ("rebind.example.com", 400),
                             (f"evil.example:{port}", 400)):
            r = httpx.get(url + "/v1/models", headers={"Host": host})
            assert r.status_code == status, host
        assert httpx.get(url + "/health", headers={"Host": "evil.example"}).json()["error"]["code"] == "invalid_host"
    with serve_in_thread(_app(models, api_key="k")) as url:  # with a key: any host name
        r = httpx.get(url + "/v1/models", headers={"Host": "api.example.com", "Authorization": "Bearer k"})
        assert r.status_code == 200
    with serve_in_thread(_app(models, allowed_hosts=["*.example.com"])) as url:
        assert httpx.get(url + "/health", headers={"Host": "a.example.com"}).status_code == 200
        assert httpx.get(url + "/health", headers={"Host": "example.org"}).status_code == 400


# --------------------------------------------------------------------------- queue accounting


def test_prompt_lists_and_n_count_against_the_queue(models):
    with serve_in_thread(_app(models, max_batch_size=1, max_queue_size=2)) as url:
        for extra, param in (({"prompt": ["Hi"] * 200}, "prompt"), ({"prompt": "Hi", "n": 8}, "n")):
            # More sequences than slots + queue can ever hold: a 400, not a 429 a client retries forever.
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "max_tokens": 1, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, extra
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "max_tokens": 1, "prompt": ["a", "b", "c"]})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3  # 1 slot + 2 queued: fits


# --------------------------------------------------------------------------- OpenAI / vLLM defaults


def test_completions_default_to_16_tokens(models):
    with serve_in_thread(_app(models)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.completions.create(model=MODEL, prompt="Count with me:", temperature=0)
        assert r.usage.completion_tokens == 16 or r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens <= 16


@pytest.fixture(scope="module")
def server(models):
    with serve_in_thread(_app(models)) as url:
        yield url


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}), ("logit_bias", {"50": 100}), ("best_of", 2),
    ("min_tokens", 5), ("ignore_eos", True), ("repetition_penalty", 1.2), ("stop_token_ids", [5]),
    ("functions", [{"name": "f"}]),
])
def test_unsupported_fields_get_a_400_naming_them(server, field, value):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(server + path, json={"model": MODEL, "max_tokens": 2, field: value, **body})
        assert r.status_code == 400, (path, field)
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == "unsupported_parameter"


def test_neutral_values_of_unsupported_fields_are_accepted(server):
    neutral = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {},
               "best_of": 1, "min_tokens": 0, "ignore_eos": False, "repetition_penalty": 1.0, "stop_token_ids": []}
    # The server has no warm-up: this first accepted request compiles its prefill and round.
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **neutral},
                   timeout=300)
    assert r.status_code == 200, r.text

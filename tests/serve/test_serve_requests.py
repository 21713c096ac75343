"""What a request may ask (#49): bounded stop strings, valid Unicode, no silently ignored
fields, JSON bodies only, no empty API key. Each test failed on the code before its fix."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError
from test_serve import MAX_LEN, MODEL, _tiny_models

from peagle_jax.serve import ServeConfig, create_app
from peagle_jax.serve.errors import APIError
from peagle_jax.serve.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS, ChatCompletionRequest, CompletionRequest
from peagle_jax.serve.request_checks import check_model_and_options
from peagle_jax.serve.testing import serve_in_thread


def test_stop_strings_are_bounded_and_the_error_names_stop():
    ok = CompletionRequest(prompt="x", stop=["s"] * MAX_STOP_STRINGS)
    assert len(ok.stop) == MAX_STOP_STRINGS
    for stop in (["s"] * 40_000, ["s"] * (MAX_STOP_STRINGS + 1), ["x" * (MAX_STOP_CHARS + 1)]):
        with pytest.raises(ValidationError) as e:
            CompletionRequest(prompt="x", stop=stop)
        assert e.value.errors()[0]["loc"] == ("stop",)


def test_lone_surrogates_are_refused_where_they_enter():
    for build in (lambda: ChatCompletionRequest(messages=[{"role": "user", "content": "hi \ud800"}]),
                  lambda: ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text",
                                                                                        "text": "\udfff"}]}]),
                  lambda: CompletionRequest(prompt="a", stop=["\ud83d"]),
                  lambda: CompletionRequest(prompt=["fine", "bad \udc00"])):
        with pytest.raises(ValidationError, match="lone surrogate"):
            build()
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "emoji \U0001f600"}])


def test_unimplemented_fields_are_refused_not_ignored():
    for field, value in (("top_logprobs", 3), ("parallel_tool_calls", True), ("parallel_tool_calls", False)):
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **{field: value})
        with pytest.raises(APIError) as e:
            check_model_and_options(req, frozenset({MODEL}))
        assert e.value.status == 400 and e.value.param == field
    check_model_and_options(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_logprobs=0),
                            frozenset({MODEL}))


def test_an_empty_api_key_is_an_error_not_auth_off():
    with pytest.raises(ValidationError, match="api_key is empty"):
        ServeConfig(api_key="")
    assert ServeConfig(api_key="k").api_key == "k" and ServeConfig().api_key is None


def test_a_keyless_server_takes_only_json_bodies():
    target, drafter, tok, eos = _tiny_models()
    config = ServeConfig(max_batch_size=1, max_model_len=MAX_LEN, num_draft_tokens=2, warmup=False,
                         served_model_name=MODEL)
    with serve_in_thread(create_app(config, target=target, drafter=drafter, tokenizer=tok, eos_ids=eos)) as url:
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1})
        for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
            r = httpx.post(url + "/v1/completions", content=body, headers=headers, timeout=60)
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", headers
        r = httpx.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json; "
                                                                                       "charset=utf-8"}, timeout=300)
        assert r.status_code == 200


def test_a_prompt_too_big_for_any_tokenization_is_refused_before_tokenizing():
    target, drafter, tok, eos = _tiny_models()
    config = ServeConfig(max_batch_size=1, max_model_len=MAX_LEN, num_draft_tokens=2, warmup=False,
                         served_model_name=MODEL)
    app = create_app(config, target=target, drafter=drafter, tokenizer=tok, eos_ids=eos)
    ctx = app.state.context
    encoded = []
    real_encode, real_chat = ctx.encode_text, ctx.encode_chat
    object.__setattr__(ctx, "encode_text", lambda text: encoded.append(len(text)) or real_encode(text))
    object.__setattr__(ctx, "encode_chat", lambda messages: encoded.append(-1) or real_chat(messages))
    huge = "word " * 800_000  # 4 MB
    with serve_in_thread(app) as url:
        for path, body, param in (("/v1/completions", {"prompt": huge}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]},
                                   "messages")):
            r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=60)
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == param
        assert encoded == []  # never tokenized
        # A busy tokenizer copy (a long prompt being encoded) does not hold up another request.
        with ctx._tokenizer():
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                           timeout=300)
            assert r.status_code == 200 and encoded == [2]


def test_requests_that_can_never_fit_or_ask_too_many_drafts_name_the_field():
    target, drafter, tok, eos = _tiny_models()
    config = ServeConfig(max_batch_size=1, max_model_len=MAX_LEN, num_draft_tokens=2, max_queue_size=2,
                         warmup=False, served_model_name=MODEL)
    with serve_in_thread(create_app(config, target=target, drafter=drafter, tokenizer=tok, eos_ids=eos)) as url:
        for extra, param in (({"prompt": "hi", "n": 4}, "n"), ({"prompt": ["a", "b", "c", "d"]}, "prompt"),
                             ({"prompt": "hi", "num_speculative_tokens": 3}, "num_speculative_tokens")):
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "max_tokens": 1, **extra}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)

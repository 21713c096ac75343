"""The real default model (SmolLM2-135M-Instruct) through the server, as `python -m
peagle_jax.serve` would load it: greedy chat output equals `speculative_generate`."""

from __future__ import annotations

import logging

import openai
import pytest

from peagle_jax.api import chat_ids
from peagle_jax.serve import ServeConfig, create_app
from peagle_jax.serve.testing import serve_in_thread

pytestmark = pytest.mark.slow


def test_default_model_through_the_server(caplog):
    from peagle_jax.generate import speculative_generate

    config = ServeConfig(max_batch_size=2, max_model_len=512, warmup=False)
    with caplog.at_level(logging.WARNING, logger="peagle_jax.serve"):
        app = create_app(config)  # default model; no trained head in the checkout -> method none
    method = app.state.method
    if method == "none":
        assert "WITHOUT speculative decoding" in caplog.text
    engine = app.state.engine
    tok = engine.tokenizer
    msg = "What is the capital of France? Answer in one sentence."
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
        r = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=40,
                                           messages=[{"role": "user", "content": msg}])
        chunks = list(client.chat.completions.create(model="default", temperature=0, max_tokens=40, stream=True,
                                                     messages=[{"role": "user", "content": msg}]))
    ids = chat_ids(tok, msg)
    ref = speculative_generate(engine_target(app), None, [ids], method="none", max_new_tokens=40,
                               eos_token_ids=list(engine.runner.eos.tolist()))
    text = tok.decode(ref.tokens[0], skip_special_tokens=True)
    assert "Paris" in text
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == ref.finish_reasons[0]
    assert r.usage.completion_tokens == len(ref.tokens[0])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def engine_target(app):
    return app.state.engine.target

"""The playground page at / and the stream's `return_draft_info` extension it reads.

A tiny random llama target drafts with prompt lookup (method ngram): it soon falls into a loop
(seed 2 does within 80 tokens of QUESTION), so drafts get accepted and the page has highlighted
drafts to show. The page is driven in a real browser, Debian's headless Chromium (`apt install
chromium`; .ci/run installs it), through Playwright; its screenshot is kept in the test's folder
(and in $PEAGLE_TEST_ARTIFACTS when set: .ci/run keeps it in .ci/artifacts).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from conftest import tiny_target_with_real_tokenizer

from peagle_jax.serve import ServeConfig, create_app
from peagle_jax.serve.testing import CHROMIUM, ask_playground, chromium, serve_in_thread

K = 3
MODEL = "tiny-ngram"
QUESTION = "one two three one two three one two"
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def server():
    from peagle_jax.drafters.ngram import NgramProposer

    target, tok, eos = tiny_target_with_real_tokenizer(layers=2, seed=2)
    config = ServeConfig(max_batch_size=2, max_model_len=256, num_draft_tokens=K, prefill_chunk=64,
                         served_model_name=MODEL, warmup=False)
    app = create_app(config, target=target, drafter=NgramProposer(), tokenizer=tok, eos_ids=eos, method="ngram")
    with serve_in_thread(app) as url:
        yield url


def _chat(**extra) -> dict:
    return dict(messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS, temperature=0, **extra)


def _stream(url: str, body: dict, endpoint: str = "/v1/chat/completions") -> list[dict]:
    """The stream's chunks (JSON), up to [DONE]."""
    chunks = []
    with httpx.stream("POST", url + endpoint, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_the_stream_reports_each_token_and_its_draft_depth(server):
    chunks = _stream(server, _chat(stream=True, return_draft_info=True, stream_options={"include_usage": True}))
    usage = chunks[-1]["usage"]
    choices = [c["choices"][0] for c in chunks[:-1]]
    tokens = [t for c in choices[1:] for t in c["draft_info"]]  # the opening chunk names the role only
    assert "draft_info" not in choices[0]
    for c in choices[1:]:  # a chunk's tokens' texts join to its text (the end's released text has no tokens)
        if c["finish_reason"] is None:
            assert "".join(t["text"] for t in c["draft_info"]) == c["delta"].get("content", "")
        else:
            assert c["draft_info"] == []
    depths = [t["depth"] for t in tokens]
    spec = usage["speculation"]
    assert len(tokens) == usage["completion_tokens"]
    assert all(0 <= d <= K for d in depths)
    # Every accepted draft is reported, but for those the last round accepted past max_tokens.
    drafted, accepted, rounds = sum(d > 0 for d in depths), spec["accepted_tokens"], spec["target_forwards"]
    assert 0 < drafted <= accepted <= drafted + K  # precondition: drafts were accepted
    assert depths.count(0) in (rounds, rounds + 1)  # the prefill's token, each round's own (not the last's if cut)
    for i, d in enumerate(depths):  # a round's drafts come in order 1, 2, ... from its start
        assert d == 0 or d == (depths[i - 1] + 1 if i and depths[i - 1] > 0 else 1)
    # The same request without the extension: the same text, and chunks as OpenAI sends them.
    plain = _stream(server, _chat(stream=True))
    assert all("draft_info" not in c["choices"][0] for c in plain)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in plain)
    assert text == "".join(c["delta"].get("content") or "" for c in choices)


def test_text_completions_stream_draft_info_too(server):
    body = dict(prompt=QUESTION, max_tokens=24, temperature=0, stream=True, return_draft_info=True)
    chunks = [c["choices"][0] for c in _stream(server, body, "/v1/completions")]
    tokens = [t for c in chunks for t in c["draft_info"]]
    assert 0 < len(tokens) <= 24 and all(0 <= t["depth"] <= K for t in tokens)
    for c in chunks:
        if c["finish_reason"] is None:
            assert "".join(t["text"] for t in c["draft_info"]) == c["text"]


def test_draft_info_needs_a_stream_and_health_names_the_drafting(server):
    r = httpx.post(server + "/v1/chat/completions", json=_chat(return_draft_info=True), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_draft_info"
    h = httpx.get(server + "/health").json()
    assert (h["method"], h["head"], h["num_draft_tokens"], h["adaptive"]) == ("ngram", None, K, False)
    page = httpx.get(server + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "return_draft_info" in page.text
    assert not any(a in page.text for a in ("src=", "href=", "@import", "url(")), "the page loads nothing else"


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no {CHROMIUM}: install Debian's chromium (apt install chromium; .ci/run does)")
    pytest.importorskip("playwright.sync_api", reason="playwright (the test extra) is not installed")
    with chromium() as b:
        yield b


def _keep(path: Path) -> None:
    folder = os.environ.get("PEAGLE_TEST_ARTIFACTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(folder) / path.name)


def test_the_page_streams_an_answer_with_its_drafts_highlighted(server, browser, tmp_path):
    reference = httpx.post(server + "/v1/chat/completions", json=_chat(), timeout=300).json()
    answer = reference["choices"][0]["message"]["content"]
    page = browser.new_page(viewport={"width": 1100, "height": 760})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server + "/")
    page.wait_for_function(f"document.getElementById('model').textContent === '{MODEL}'")
    assert page.inner_text("#method") == "ngram" and page.inner_text("#server-k") == str(K)

    ask_playground(page, QUESTION, k=K, max_tokens=MAX_TOKENS)
    message = page.locator(".msg.assistant").last
    assert message.locator(".body").inner_text() == answer  # the greedy answer, token for token
    drafts = message.locator(".tok.draft")
    assert drafts.count() > 0
    assert {int(d) for d in drafts.evaluate_all("els => els.map(e => e.dataset.depth)")} <= set(range(1, K + 1))
    stats = message.locator(".stats").inner_text()
    assert "tok/s" in stats and "acceptance length" in stats and "done" in stats
    shot = tmp_path / "playground.png"
    page.screenshot(path=str(shot), full_page=True)
    _keep(shot)

    page.click("#clear")
    ask_playground(page, QUESTION, k=0, max_tokens=MAX_TOKENS)  # K 0: the same answer, no drafts
    message = page.locator(".msg.assistant").last
    assert message.locator(".body").inner_text() == answer
    assert message.locator(".tok.draft").count() == 0
    assert "acceptance length 1.00" in message.locator(".stats").inner_text()
    assert not errors, errors

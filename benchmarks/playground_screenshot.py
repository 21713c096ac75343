"""A screenshot of the playground page of a running server, after it answered a prompt: the
picture the README shows (docs/images/playground.png).

  python -m peagle_jax.serve &        # the default model and its P-EAGLE head
  .venv/bin/python -m benchmarks.playground_screenshot [--url http://127.0.0.1:8000]
      [--prompt "..."] [--max-tokens 160] [--out docs/images/playground.png]

Needs Debian's Chromium (`apt install chromium`) and playwright (the test extra).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path

from peagle_jax.serve.testing import ask_playground, chromium

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def wait_warm(url: str, timeout_s: float) -> None:
    """Wait until the server has nothing left to compile (its figures are then the warm ones)."""
    deadline = time.monotonic() + timeout_s
    while json.load(urllib.request.urlopen(url + "/health")).get("compiling"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} still compiling after {timeout_s} s")
        time.sleep(2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--out", default="docs/images/playground.png")
    a = ap.parse_args(argv)
    url = a.url.rstrip("/")
    wait_warm(url, 1800)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1100, "height": 1040})
        page.goto(url + "/")
        page.wait_for_function("document.getElementById('model').textContent !== '…'")
        if a.api_key:
            page.fill("#api-key", a.api_key)
        ask_playground(page, a.prompt, max_tokens=a.max_tokens)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=a.out)
        print(f"wrote {a.out}: {page.locator('.msg.assistant .stats').last.inner_text()}")


if __name__ == "__main__":
    main()

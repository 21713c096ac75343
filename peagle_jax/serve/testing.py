"""Run an app with uvicorn in a background thread on a free loopback port (tests, notebooks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app, *, host: str = "127.0.0.1", port: int | None = None, startup_timeout: float = 300.0,
                    drain_timeout: float = 5.0, log_level: str = "warning") -> Iterator[str]:
    """Yield the base URL (http://host:port) once the app's lifespan startup is done."""
    import uvicorn

    port = port or free_port(host)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server thread exited during startup")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError("the server did not start in time")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


#: Debian's Chromium (`apt install chromium`), which drives the playground page's test.
CHROMIUM = "/usr/bin/chromium"
# Headless as root on a machine with no outside network: no sandbox, no GPU, and none of the
# background connections Chromium would otherwise keep retrying.
_CHROMIUM_FLAGS = ("--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                   "--disable-background-networking", "--disable-component-update", "--disable-sync")


@contextlib.contextmanager
def chromium(executable: str = CHROMIUM):
    """A headless Chromium browser driven by Playwright (no browser download: Debian's binary)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=list(_CHROMIUM_FLAGS))
        try:
            yield browser
        finally:
            browser.close()


def ask_playground(page, prompt: str, *, k: int | None = None, max_tokens: int = 256, temperature: float = 0.0,
                   timeout_s: float = 300.0) -> None:
    """Send `prompt` from the playground page (serve/playground.html) and wait for its answer;
    k None keeps the page's (the server's K)."""
    if k is not None:
        page.fill("#k", str(k))
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", str(temperature))
    page.fill("#prompt", prompt)
    page.click("#send")
    page.wait_for_function("['done', 'error', 'stopped'].includes(document.getElementById('status').textContent)",
                           timeout=timeout_s * 1000)
    status = page.inner_text("#status")
    if status != "done":
        answer = page.locator(".msg.assistant").last.inner_text()
        raise RuntimeError(f"the page's request ended with {status!r}: {answer}")

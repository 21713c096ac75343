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

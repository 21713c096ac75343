"""Request counting for the `peagle_http_requests` metric."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from peagle_jax.serve.metrics import Metrics

__all__ = ["RequestCounter"]


class RequestCounter:
    """Counts HTTP requests by endpoint and status. Pure ASGI middleware, because
    BaseHTTPMiddleware would interfere with streaming disconnects. Paths outside `paths` count
    as "other" so random URLs cannot grow the label set."""

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: Iterable[str]):
        self.app, self.metrics, self.paths = app, metrics, frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # unless a response starts

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in self.paths else "other"
            self.metrics.http_requests.labels(endpoint=endpoint, status=str(status)).inc()

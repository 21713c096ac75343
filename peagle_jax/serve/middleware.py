"""Pure ASGI middleware (BaseHTTPMiddleware would interfere with streaming disconnects):

  RequestCounter  counts HTTP requests by endpoint and status (`peagle_http_requests`);
  RequestGate     answers before any body is read: a Host header outside the allowed list
                  gets 400 (DNS rebinding), a /v1 request without the API key 401, a body over
                  the size limit 413 (by Content-Length, or while a chunked body streams in).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from peagle_jax.serve.auth import api_key_ok
from peagle_jax.serve.errors import ErrorBody
from peagle_jax.serve.metrics import Metrics

__all__ = ["RequestCounter", "RequestGate", "host_allowed"]


class RequestCounter:
    """Counts HTTP requests by endpoint and status. Paths outside `paths` count as "other" so
    random URLs cannot grow the label set."""

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


def _host_name(host_header: str) -> str:
    """The host of a Host header, without port or IPv6 brackets, lower case."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:].partition("]")[0]
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def host_allowed(host_header: str | None, allowed: Sequence[str] | None) -> bool:
    """Whether a Host header is served: any host when `allowed` is None or holds "*"; else a
    listed name ("*.example.com" matches subdomains) or an IP literal."""
    if allowed is None or "*" in allowed:
        return True
    name = _host_name(host_header or "")
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    for pattern in allowed:
        p = pattern.lower()
        if name == p or (p.startswith("*.") and name.endswith(p[1:])):
            return True
    return False


def _is_json(headers: Headers) -> bool:
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class RequestGate:
    """Host check, API key, JSON content type and body-size limit in front of everything else."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 allowed_hosts: Sequence[str] | None):
        self.app, self.api_key, self.max_body_bytes, self.allowed_hosts = app, api_key, max_body_bytes, allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if not host_allowed(headers.get("host"), self.allowed_hosts):
            return await _reply(send, 400, ErrorBody.of(
                "invalid Host header: this server answers only the host names in its allowed_hosts setting",
                "invalid_request_error", None, "invalid_host"))
        if scope.get("path", "").startswith("/v1/") and not api_key_ok(headers.get("authorization"), self.api_key):
            return await _reply(send, 401, ErrorBody.of(
                "invalid or missing API key (send 'Authorization: Bearer <key>')", "authentication_error", None,
                "invalid_api_key"), {"WWW-Authenticate": "Bearer"})
        if scope.get("method") == "POST" and scope.get("path", "").startswith("/v1/") and not _is_json(headers):
            # A browser page may POST text/plain or a form anywhere without asking first (no CORS
            # preflight); only a JSON body is an API call, so such a page cannot make a keyless
            # server generate.
            return await _reply(send, 415, ErrorBody.of(
                "the request body must be JSON: send 'Content-Type: application/json'", "invalid_request_error",
                None, "unsupported_media_type"))
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await _reply(send, 413, self._too_large())
        await self.app(scope, self._counting(receive), send)

    def _too_large(self) -> ErrorBody:
        return ErrorBody.of(f"request body exceeds the server's limit of {self.max_body_bytes} bytes",
                            "invalid_request_error", None, "request_too_large")

    def _counting(self, receive: Receive) -> Receive:
        """`receive` that stops a chunked body at the limit (FastAPI re-raises HTTPException)."""
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise HTTPException(413, self._too_large().error.message)
            return message

        return wrapped


async def _reply(send: Send, status: int, body: ErrorBody, headers: dict[str, str] | None = None) -> None:
    payload = body.model_dump_json().encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})

"""Bearer API-key check for the /v1 routes (health and metrics stay open for probes)."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from peagle_jax.serve.context import ServerContext, get_context
from peagle_jax.serve.errors import APIError

__all__ = ["require_api_key"]


async def require_api_key(request: Request, ctx: Annotated[ServerContext, Depends(get_context)]) -> None:
    """FastAPI dependency; a no-op when the server has no key. Compares in constant time."""
    if not ctx.config.api_key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), ctx.config.api_key.encode()):
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                       code="invalid_api_key", type="authentication_error")

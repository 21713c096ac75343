"""Bearer API-key check for the /v1 routes (health and metrics stay open for probes)."""

from __future__ import annotations

import secrets

__all__ = ["api_key_ok"]


def api_key_ok(authorization: str | None, api_key: str | None) -> bool:
    """Whether an `Authorization` header carries `api_key` (always True without a key).
    Compares in constant time."""
    if not api_key:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())

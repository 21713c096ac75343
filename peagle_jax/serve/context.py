"""What the route handlers share: one object per app on `app.state.context`, handed to the
handlers as a dependency so they stay module-level functions instead of closures."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from fastapi import Request

from peagle_jax.api import chat_ids
from peagle_jax.serve.config import ServeConfig
from peagle_jax.serve.engine import Engine
from peagle_jax.serve.metrics import Metrics

__all__ = ["ServerContext", "get_context"]


@dataclasses.dataclass(frozen=True)
class ServerContext:
    engine: Engine
    config: ServeConfig
    metrics: Metrics
    tokenizer: Any  # for requests: a copy of the engine's (see encode_lock)
    model_name: str
    model_aliases: frozenset[str]  # names a request may use for the served model
    method: str
    max_model_len: int
    created: int  # the model's "created" timestamp: when the app was built

    # Request tokenizing has its own copy of the tokenizer and its own lock: a huge prompt
    # being encoded never holds up the engine thread's detokenizing (other streams' tokens).
    encode_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def encode_text(self, text: str) -> list[int]:
        with self.encode_lock:  # one tokenizer object is not safe across threads
            return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        with self.encode_lock:
            return chat_ids(self.tokenizer, messages)


async def get_context(request: Request) -> ServerContext:
    """FastAPI dependency (async, so it runs on the event loop, not in the thread pool)."""
    return request.app.state.context

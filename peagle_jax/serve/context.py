"""What the route handlers share: one object per app on `app.state.context`, handed to the
handlers as a dependency so they stay module-level functions instead of closures."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import queue
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
    tokenizer: Any  # for requests: a copy of the engine's (see pool)
    model_name: str
    model_aliases: frozenset[str]  # names a request may use for the served model
    method: str
    head: str | None  # the draft head's name, for /health and the playground page
    max_model_len: int
    created: int  # the model's "created" timestamp: when the app was built

    # Request tokenizing has its own copies of the tokenizer: a huge prompt being encoded never
    # holds up the engine thread's detokenizing (other streams' tokens), nor a small request
    # that arrives meanwhile (one shared copy behind a lock made it wait 6.6 s: issue #49, F3).
    pool: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    max_token_bytes: int = 0  # the most UTF-8 bytes any one token stands for (an upper bound)

    def __post_init__(self):
        copies = [self.tokenizer] + [copy.deepcopy(self.tokenizer) for _ in range(_TOKENIZER_COPIES - 1)]
        for t in copies:
            self.pool.put(t)
        object.__setattr__(self, "max_token_bytes", _max_token_bytes(self.tokenizer))

    def encode_text(self, text: str) -> list[int]:
        with self._tokenizer() as tok:  # one tokenizer object is not safe across threads
            return list(tok.encode(text))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        with self._tokenizer() as tok:
            return chat_ids(tok, messages)

    def min_tokens(self, text_bytes: int) -> int:
        """The fewest tokens `text_bytes` bytes of text can become: a prompt whose bound already
        exceeds the context is refused before it is tokenized."""
        return -(-text_bytes // max(self.max_token_bytes, 1))

    @contextlib.contextmanager
    def _tokenizer(self):
        tok = self.pool.get()
        try:
            yield tok
        finally:
            self.pool.put(tok)


_TOKENIZER_COPIES = 4


def _max_token_bytes(tokenizer) -> int:
    """An upper bound on the bytes one token decodes to (its vocabulary entry's UTF-8 length:
    a byte-level entry spells each byte with one character of up to 2 bytes), at least 1."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(t.encode("utf-8", "replace")) for t in vocab), default=1) or 1


async def get_context(request: Request) -> ServerContext:
    """FastAPI dependency (async, so it runs on the event loop, not in the thread pool)."""
    return request.app.state.context

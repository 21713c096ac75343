"""Server-sent events for `stream: true`: one loop for completions and chat, differing only in
the chunks they build (see `responses.ChunkFactory`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pydantic import BaseModel

from peagle_jax.serve.engine import Delta, Failed, Finished
from peagle_jax.serve.errors import ErrorBody
from peagle_jax.serve.generation import Generation
from peagle_jax.serve.responses import ChunkFactory

__all__ = ["sse", "stream_events"]

SSE_DONE = "data: [DONE]\n\n"


def sse(body: BaseModel) -> str:
    return f"data: {json.dumps(body.model_dump(mode='json'), ensure_ascii=False)}\n\n"


async def stream_events(generation: Generation, chunks: ChunkFactory, include_usage: bool) -> AsyncIterator[str]:
    """The SSE lines of one streamed response, ending with `data: [DONE]`. A failed choice gets an
    error event and the others carry on. Whether the stream ends or the client goes away (the
    task is cancelled), the engine slots are freed."""
    pending = len(generation.requests)
    done: list[Finished] = []
    try:
        for index in range(len(generation.requests)):
            opening = chunks.opening(index)
            if opening is not None:
                yield sse(opening)
        while pending:
            index, ev = await generation.events.get()
            if isinstance(ev, Delta):
                yield sse(chunks.piece(index, ev.text, None, ev.pieces))
            elif isinstance(ev, Finished):
                pending -= 1
                done.append(ev)
                # The text released at the end belongs to tokens already reported: no new pieces.
                end_pieces = [] if generation.requests[index].draft_info else None
                yield sse(chunks.piece(index, ev.text, ev.reason, end_pieces))
            elif isinstance(ev, Failed):
                pending -= 1
                yield sse(ErrorBody.of(ev.message, "server_error"))
        if include_usage:
            yield sse(chunks.usage(generation.usage(done)))
        yield SSE_DONE
    finally:
        generation.cancel()

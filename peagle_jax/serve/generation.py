"""The bridge between a request handler (event loop) and the engine (its own thread): submit
the engine requests of one API call, then gather their events from a thread-safe queue."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from starlette.requests import Request

from peagle_jax.serve.engine import Delta, Engine, EngineStopped, Failed, Finished, GenRequest, QueueFull
from peagle_jax.serve.errors import APIError
from peagle_jax.serve.responses import Usage
from peagle_jax.serve.sampling_settings import SamplingSettings

__all__ = ["Event", "Generation", "collect", "start_generation"]

Event = Delta | Finished | Failed

# How often a non-streaming request looks whether its client is still there (also while
# tokens keep arriving: a busy request must notice a gone client as fast as an idle one).
_DISCONNECT_POLL_S = 0.25
# Seconds a 429 asks the client to wait before retrying (the Retry-After header).
RETRY_AFTER_S = 1


# The request field an engine check names first in its message (`Engine.check_request`).
_PARAMS = {"num_speculative_tokens": "num_speculative_tokens", "max_new_tokens": "max_tokens",
           "temperature": "temperature", "top_k": "top_k", "top_p": "top_p"}


@dataclasses.dataclass(frozen=True)
class Generation:
    """The engine requests of one API call, one per (prompt, choice) in choice-index order; the
    engine thread posts their events to `events` as (choice index, event)."""

    engine: Engine
    requests: list[GenRequest]
    events: asyncio.Queue[tuple[int, Event]]
    prompt_tokens: int  # each prompt counted once, whatever n is (as OpenAI and vLLM report usage)

    def cancel(self) -> None:
        """Free the engine slots; requests that already finished are left alone."""
        for r in self.requests:
            self.engine.cancel(r)

    def usage(self, results: Sequence[Finished]) -> Usage:
        asked = self.requests[0].num_speculative_tokens if self.requests else None  # one setting per call
        k = self.engine.num_draft_tokens if asked is None else asked
        return Usage.of(self.prompt_tokens, results, method=self.engine.method, num_draft_tokens=k)


def start_generation(engine: Engine, prompts: list[list[int]], budgets: list[int], settings: SamplingSettings,
                     n: int) -> Generation:
    """Submit n choices per prompt, all or none: a full queue or a stopping engine cancels the
    ones already queued and answers 429 / 503. Must run on the event loop."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    def sink_for(index: int):
        return lambda ev: loop.call_soon_threadsafe(events.put_nowait, (index, ev))

    requests: list[GenRequest] = []
    for ids, budget in zip(prompts, budgets, strict=True):
        for choice in range(n):
            requests.append(settings.for_choice(choice).gen_request(ids, budget, sink_for(len(requests))))
    generation = Generation(engine, requests, events, sum(len(p) for p in prompts))
    capacity = engine.max_batch_size + engine.max_queue_size
    if len(requests) > capacity:  # never fits, however long the client waits: not a 429 to retry
        raise APIError(400, f"{len(prompts)} prompts x n={n} = {len(requests)} sequences can never fit this server's "
                       f"{engine.max_batch_size} slots and queue of {engine.max_queue_size}",
                       param="n" if n > 1 else "prompt", code="invalid_value")
    try:
        engine.submit_all(requests)  # every prompt x choice counts against the queue, atomically
    except QueueFull as e:
        raise APIError(429, str(e), code="rate_limit_exceeded", type="rate_limit_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from e
    except EngineStopped as e:
        raise APIError(503, str(e), code="shutting_down", type="server_error") from e
    except ValueError as e:  # a setting the engine's arrays cannot hold: this request's fault only
        field = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=_PARAMS.get(field), code="invalid_value") from e
    return generation


async def collect(generation: Generation, request: Request) -> tuple[list[str], list[Finished]] | None:
    """Every choice's full text and final event, or None if the client went away first (its
    engine slots are freed either way)."""
    texts: list[list[str]] = [[] for _ in generation.requests]
    results: list[Finished | None] = [None] * len(generation.requests)
    pending = len(generation.requests)
    loop = asyncio.get_running_loop()
    next_check = loop.time() + _DISCONNECT_POLL_S
    try:
        while pending:
            if loop.time() >= next_check:
                if await request.is_disconnected():
                    return None
                next_check = loop.time() + _DISCONNECT_POLL_S
            try:
                index, ev = await asyncio.wait_for(generation.events.get(), timeout=_DISCONNECT_POLL_S)
            except TimeoutError:
                continue
            if isinstance(ev, Delta):
                texts[index].append(ev.text)
            elif isinstance(ev, Finished):
                texts[index].append(ev.text)
                results[index] = ev
                pending -= 1
            elif isinstance(ev, Failed):
                raise APIError(500, ev.message, type="server_error")
    finally:
        generation.cancel()
    if any(r.reason == "abort" for r in results):
        raise APIError(503, "the request was cancelled because the server is shutting down",
                       type="server_error", code="shutting_down")
    return ["".join(t) for t in texts], results

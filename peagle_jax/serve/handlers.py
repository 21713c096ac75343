"""The HTTP routes. Module-level handlers on one router: everything per app (engine, config,
tokenizer) comes from `ServerContext` through a dependency, so any number of apps can share them.
The API key, the Host check and the body-size limit are enforced before a body is read, by
`middleware.RequestGate`."""

from __future__ import annotations

import time
import uuid
from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from peagle_jax.serve.context import ServerContext, get_context
from peagle_jax.serve.errors import APIError
from peagle_jax.serve.generation import Generation, collect, start_generation
from peagle_jax.serve.protocol import ChatCompletionRequest, CompletionRequest
from peagle_jax.serve.request_checks import check_model_and_options, check_prompt_bytes, prompt_budget
from peagle_jax.serve.responses import (
    ChatChunks,
    ChatCompletion,
    ChunkFactory,
    Completion,
    CompletionChunks,
    Health,
    ModelCard,
    ModelList,
)
from peagle_jax.serve.sampling_settings import SamplingSettings
from peagle_jax.serve.streaming import stream_events

__all__ = ["ROUTE_PATHS", "router"]

router = APIRouter()
_PLAYGROUND = (resources.files("peagle_jax.serve") / "playground.html").read_text(encoding="utf-8")
Context = Annotated[ServerContext, Depends(get_context)]


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(ctx: Context) -> Health:
    e = ctx.engine
    return Health(model=ctx.model_name, method=ctx.method, head=ctx.head, num_draft_tokens=e.num_draft_tokens,
                  adaptive=e.adaptive, compiling=e.compiling(), **e.stats())


@router.get("/", include_in_schema=False)
async def playground() -> HTMLResponse:
    """The playground page (serve/playground.html): a chat that streams with draft info."""
    return HTMLResponse(_PLAYGROUND)


@router.get("/metrics")
async def metrics(ctx: Context) -> Response:
    # Refresh the load gauges (the engine sets them as it works) so a scrape sees the current load.
    stats = ctx.engine.stats()
    ctx.metrics.queue_depth.set(stats["waiting"])
    ctx.metrics.batch_occupancy.set(stats["active"])
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(ctx: Context) -> ModelList:
    return ModelList(data=[ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.max_model_len)])


# response_model=None: a handler may also return a stream or a bare 499; `responses` documents the JSON.
@router.post("/v1/completions", response_model=None, responses={200: {"model": Completion}})
async def completions(req: CompletionRequest, request: Request, ctx: Context) -> Completion | Response:
    check_model_and_options(req, ctx.model_aliases)
    for param in ("echo", "suffix"):
        if getattr(req, param):
            raise APIError(400, f"{param} is not supported by this server", param=param,
                           code="unsupported_parameter")
    prompts = await _completion_prompts(req, ctx)
    budgets = [prompt_budget(ctx, p, req.max_tokens, "prompt", "max_tokens") for p in prompts]
    generation = start_generation(ctx.engine, prompts, budgets, SamplingSettings.from_request(req), req.n)
    shapes = CompletionChunks(f"cmpl-{uuid.uuid4().hex}", int(time.time()), ctx.model_name)
    return await _respond(generation, request, shapes, req.stream, req.stream_usage)


@router.post("/v1/chat/completions", response_model=None,
             responses={200: {"model": ChatCompletion}})
async def chat_completions(req: ChatCompletionRequest, request: Request, ctx: Context) -> ChatCompletion | Response:
    check_model_and_options(req, ctx.model_aliases)
    ids = await _chat_prompt(req, ctx)
    max_tokens, max_param = req.token_limit()
    budget = prompt_budget(ctx, ids, max_tokens, "messages", max_param)
    generation = start_generation(ctx.engine, [ids], [budget], SamplingSettings.from_request(req), req.n)
    shapes = ChatChunks(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), ctx.model_name)
    return await _respond(generation, request, shapes, req.stream, req.stream_usage)


ROUTE_PATHS = frozenset(route.path for route in router.routes)


# --------------------------------------------------------------------------- helpers


async def _respond(generation: Generation, request: Request, shapes: ChunkFactory, stream: bool,
                   stream_usage: bool) -> BaseModel | Response:
    """Stream the generation as SSE chunks, or wait for it and return the whole response."""
    if stream:
        return _event_stream(generation, shapes, stream_usage)
    out = await collect(generation, request)
    if out is None:
        return _client_closed()
    texts, results = out
    return shapes.complete(texts, [r.reason for r in results], generation.usage(results))


async def _completion_prompts(req: CompletionRequest, ctx: ServerContext) -> list[list[int]]:
    """Token ids per prompt: `prompt` is one text, a batch of texts, or one pre-tokenized prompt.
    Tokenizing runs in the thread pool: long prompts must not stall the event loop."""
    if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], str)):
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        for text in texts:
            check_prompt_bytes(ctx, len(text.encode("utf-8")), "prompt")  # valid Unicode: protocol checked
        prompts = [await run_in_threadpool(ctx.encode_text, text) for text in texts]
    else:
        prompts = [list(req.prompt)]
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
    return prompts


async def _chat_prompt(req: ChatCompletionRequest, ctx: ServerContext) -> list[int]:
    """The conversation through the model's chat template; what the template rejects is a 400."""
    try:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    except ValueError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from e
    check_prompt_bytes(ctx, sum(len(m["content"].encode("utf-8")) for m in messages), "messages")
    try:
        return await run_in_threadpool(ctx.encode_chat, messages)
    except Exception as e:  # template errors (e.g. roles the template rejects)
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages",
                       code="invalid_value") from e


def _event_stream(generation: Generation, chunks: ChunkFactory, include_usage: bool) -> StreamingResponse:
    return StreamingResponse(stream_events(generation, chunks, include_usage), media_type="text/event-stream")


def _client_closed() -> Response:
    # 499 (nginx's "client closed request"): nobody reads it, but the metrics and logs tell why.
    return Response(status_code=499)

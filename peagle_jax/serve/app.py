"""FastAPI app: OpenAI-compatible completions / chat completions over the engine.

`create_app` only assembles: models, engine and `ServerContext` on app.state, the routes
(handlers.py), errors (errors.py) and request counting (middleware.py)."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from peagle_jax.api import LoadedModel, method_for
from peagle_jax.serve.config import DEFAULT_DRAFTER, ServeConfig
from peagle_jax.serve.context import ServerContext
from peagle_jax.serve.engine import Engine
from peagle_jax.serve.errors import APIError, register_exception_handlers
from peagle_jax.serve.handlers import ROUTE_PATHS, router
from peagle_jax.serve.middleware import RequestCounter, RequestGate

log = logging.getLogger("peagle_jax.serve")

__all__ = ["APIError", "create_app", "load_models"]

# The built-in default model also answers to "default", so clients need not know its name.
_DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def load_models(config: ServeConfig) -> LoadedModel:
    """Load target, tokenizer and head through the library's front door (`peagle_jax.load`)."""
    from peagle_jax.api import is_default_model, load

    llm = load(options=config.options())
    if llm.drafter is None and config.drafter == "auto" and config.method == "auto" and is_default_model(config.model):
        log.warning("no trained P-EAGLE head at %s: serving %s WITHOUT speculative decoding (method none). "
                    "Pass --drafter DIR to use a draft head.", DEFAULT_DRAFTER, llm.model_name)
    return llm


def _wrap_injected(config: ServeConfig, target: Any, drafter: Any, tokenizer: Any, eos_ids: Sequence[int] | None,
                   method: str | None, served_model_name: str | None) -> LoadedModel:
    """Models handed in (tests, notebooks) as `load` would return them, sharded like loaded ones."""
    if tokenizer is None:
        raise ValueError("an injected target needs a tokenizer")
    m = method or (config.method if config.method != "auto" else None)
    if m is None:
        m = method_for(drafter)
    loaded = LoadedModel.from_target(
        target, tokenizer, drafter=drafter, method=m,
        eos_ids=list(eos_ids) if eos_ids is not None else [tokenizer.eos_token_id],
        name=served_model_name or config.served_model_name or "peagle-test")
    if config.mesh is not None:  # loaded models are placed by `load`; injected ones here, the same way
        from peagle_jax.sharding import make_mesh

        loaded.place_on(make_mesh(config.mesh))
        log.info("sharded target and drafter over mesh %s", config.mesh)
    return loaded


def _max_model_len(config: ServeConfig, loaded: LoadedModel) -> int:
    """An explicit `max_model_len` is the operator's call and is used as given; else the model's own."""
    return config.max_model_len or loaded.target.config.max_position_embeddings


def _build_context(config: ServeConfig, loaded: LoadedModel) -> ServerContext:
    max_len = _max_model_len(config, loaded)
    engine = Engine(
        loaded.target, loaded.drafter, loaded.tokenizer, loaded.eos_ids, method=loaded.method,
        num_draft_tokens=config.num_draft_tokens, max_batch_size=config.max_batch_size, max_model_len=max_len,
        max_queue_size=config.max_queue_size, max_prefill_batch=config.max_prefill_batch,
        min_prompt_bucket=config.min_prompt_bucket, prefill_chunk=config.prefill_chunk, seed=config.seed,
        adaptive=config.method == "auto",
    )
    name = loaded.model_name
    aliases = frozenset({name, "default"} if name == _DEFAULT_MODEL_NAME else {name})
    log.info("serving %s: method=%s%s K=%d batch=%d max_model_len=%d", name, loaded.method,
             " (adaptive: speculates only where it pays)" if engine.adaptive else "", engine.num_draft_tokens,
             config.max_batch_size, max_len)
    return ServerContext(engine=engine, config=config, metrics=engine.metrics,
                         tokenizer=copy.deepcopy(loaded.tokenizer),
                         model_name=name, model_aliases=aliases, method=loaded.method, head=_head_name(loaded),
                         max_model_len=max_len,
                         created=int(time.time()))


def _head_name(loaded: LoadedModel) -> str | None:
    """The draft head's folder name (no machine path), or its class for one built in memory;
    None without a head (prompt lookup drafts from the context)."""
    if loaded.drafter is None or loaded.method == "ngram":
        return None
    return Path(loaded.drafter_path).name if loaded.drafter_path else type(loaded.drafter).__name__


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start (and compile) the engine before serving; drain it on shutdown."""
    ctx: ServerContext = app.state.context
    await run_in_threadpool(ctx.engine.start, ctx.config.warmup)
    try:
        yield
    finally:
        await run_in_threadpool(ctx.engine.shutdown, ctx.config.drain_timeout)


def create_app(
    config: ServeConfig | None = None,
    *,
    target=None,
    drafter=None,
    tokenizer=None,
    eos_ids: Sequence[int] | None = None,
    method: str | None = None,
    served_model_name: str | None = None,
) -> FastAPI:
    """The server app. Models are loaded from `config` unless `target` and `tokenizer` are given
    (tests inject tiny models; then `method` defaults to peagle/eagle3 with a drafter, else none).
    The engine starts (and compiles) in the app's lifespan startup and drains on shutdown."""
    config = config or ServeConfig()
    if target is None:
        loaded = load_models(config)
    else:
        loaded = _wrap_injected(config, target, drafter, tokenizer, eos_ids, method, served_model_name)
    ctx = _build_context(config, loaded)

    app = FastAPI(title="peagle-jax", lifespan=_lifespan, docs_url=None, redoc_url=None)
    app.state.context = ctx
    # Direct handles for callers that inspect a built app (tests, notebooks).
    app.state.engine, app.state.config, app.state.metrics = ctx.engine, config, ctx.metrics
    app.state.model_name, app.state.method = ctx.model_name, ctx.method
    register_exception_handlers(app)
    app.include_router(router)
    app.add_middleware(RequestGate, api_key=config.api_key, max_body_bytes=config.max_request_bytes,
                       allowed_hosts=config.resolved_allowed_hosts())
    app.add_middleware(RequestCounter, metrics=ctx.metrics, paths=ROUTE_PATHS)  # outermost: counts gate answers
    return app

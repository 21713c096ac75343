"""FastAPI app: OpenAI-compatible completions / chat completions over the engine."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from peagle_jax.api import LoadedModel, chat_ids, method_for
from peagle_jax.serve.config import DEFAULT_DRAFTER, ServeConfig
from peagle_jax.serve.engine import Delta, Engine, EngineStopped, Failed, Finished, GenRequest, QueueFull
from peagle_jax.serve.metrics import Metrics
from peagle_jax.serve.protocol import ChatCompletionRequest, CompletionRequest, _SamplingRequest

log = logging.getLogger("peagle_jax.serve")

__all__ = ["APIError", "create_app", "load_models"]


# --------------------------------------------------------------------------- errors


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def _error_body(message: str, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(_error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=headers)


def _validation_to_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}",
                        code="invalid_json")
    if err.get("type") == "missing" and not loc:
        return APIError(400, "request body is missing or is not a JSON object", code="invalid_json")
    # Drop pydantic's union-branch names (e.g. "str", "list[int]") from the location.
    param = ".".join(x for x in loc if not x.isdigit() and "[" not in x and x not in ("str", "int", "float"))
    param = param or None
    msg = err.get("msg", "invalid value")
    return APIError(400, f"{param or 'body'}: {msg}", param=param, code="invalid_value" if err.get("type") != "missing"
                    else "missing_required_parameter")


# --------------------------------------------------------------------------- model loading


def load_models(config: ServeConfig) -> LoadedModel:
    """Load target, tokenizer and head through the library's front door (`peagle_jax.load`)."""
    from peagle_jax.api import is_default_model, load

    mesh = config.mesh
    llm = load(config.model, drafter=config.drafter or "auto", method=config.method, dtype=config.dtype,
               mesh={"data": mesh.data, "model": mesh.model} if mesh.size > 1 else None,
               attention=config.attention, kv_cache_dtype=config.kv_cache_dtype, fp8_weights=config.fp8_weights,
               served_model_name=config.served_model_name)
    if llm.drafter is None and config.drafter is None and config.method == "auto" and is_default_model(config.model):
        log.warning("no trained P-EAGLE head at %s: serving %s WITHOUT speculative decoding (method none). "
                    "Pass --drafter DIR to use a draft head.", DEFAULT_DRAFTER, llm.model_name)
    return llm


# --------------------------------------------------------------------------- app


class _CountRequests:
    """Pure ASGI middleware (BaseHTTPMiddleware would interfere with streaming disconnects)."""

    def __init__(self, app, metrics: Metrics, paths: frozenset[str]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in self.paths else "other"
            self.metrics.http_requests.labels(endpoint=endpoint, status=str(status[0])).inc()


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
        if tokenizer is None:
            raise ValueError("an injected target needs a tokenizer")
        m = method or (config.method if config.method != "auto" else None)
        if m is None:
            m = method_for(drafter)
        loaded = LoadedModel.from_target(
            target, tokenizer, drafter=drafter, method=m,
            eos_ids=list(eos_ids) if eos_ids is not None else [tokenizer.eos_token_id],
            name=served_model_name or config.served_model_name or "peagle-test")
        if config.mesh.size > 1:  # loaded models are placed by `load`; injected ones here
            from peagle_jax.sharding import make_mesh, shard_module

            device_mesh = make_mesh({"data": config.mesh.data, "model": config.mesh.model})
            for module in (loaded.target, loaded.drafter):
                if module is not None:
                    shard_module(module, device_mesh)
            log.info("sharded target and drafter over mesh %s", config.mesh)
    max_len = config.max_model_len or loaded.target.config.max_position_embeddings
    max_len = min(max_len, loaded.target.config.max_position_embeddings) if config.max_model_len is None else max_len
    k = config.num_draft_tokens if loaded.method != "none" else 0
    metrics = Metrics(k, config.max_batch_size)
    engine = Engine(
        loaded.target, loaded.drafter, loaded.tokenizer, loaded.eos_ids, method=loaded.method,
        num_draft_tokens=config.num_draft_tokens, max_batch_size=config.max_batch_size, max_model_len=max_len,
        max_queue_size=config.max_queue_size, max_prefill_batch=config.max_prefill_batch,
        min_prompt_bucket=config.min_prompt_bucket, seed=config.seed, metrics=metrics,
    )
    model_name = loaded.model_name
    model_aliases = {model_name}
    if model_name == "smollm2-135m-instruct":
        model_aliases.add("default")
    created = int(time.time())
    tok_lock = engine.tokenizer_lock
    log.info("serving %s: method=%s K=%d batch=%d max_model_len=%d", model_name, loaded.method, k,
             config.max_batch_size, max_len)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await run_in_threadpool(engine.start, config.warmup)
        try:
            yield
        finally:
            await run_in_threadpool(engine.shutdown, config.drain_timeout)

    app = FastAPI(title="peagle-jax", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.config = config
    app.state.metrics = metrics
    app.state.model_name = model_name
    app.state.method = loaded.method

    # ------------------------------------------------------------------ errors

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return _error_response(_validation_to_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(_error_body(str(exc.detail), kind, None, code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(_error_body(f"internal error: {type(exc).__name__}", "server_error", None, None),
                            status_code=500)

    # ------------------------------------------------------------------ auth

    async def check_key(request: Request) -> None:
        if not config.api_key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", type="authentication_error")

    # ------------------------------------------------------------------ helpers

    def encode_text(text: str) -> list[int]:
        with tok_lock:
            return list(loaded.tokenizer.encode(text))

    def encode_chat(messages: list[dict[str, str]]) -> list[int]:
        with tok_lock:
            return chat_ids(loaded.tokenizer, messages)

    def check_common(req: _SamplingRequest) -> None:
        if req.model is not None and req.model not in model_aliases:
            raise APIError(400, f"model {req.model!r} is not served here; available: {sorted(model_aliases)}",
                           param="model", code="model_not_found")
        bad = req.unsupported()
        if bad:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")

    def check_prompt(ids: list[int], max_tokens: int | None, param: str, max_param: str) -> int:
        if not ids:
            raise APIError(400, f"{param} is empty", param=param, code="invalid_value")
        if any(not (0 <= t < engine.vocab_size) for t in ids):
            raise APIError(400, f"{param} has token ids outside [0, {engine.vocab_size})", param=param,
                           code="invalid_value")
        if len(ids) >= max_len:
            raise APIError(400, f"{param} has {len(ids)} tokens; this model's maximum context length is {max_len} "
                           "tokens (prompt + completion), so the prompt must be shorter",
                           param=param, code="context_length_exceeded")
        if max_tokens is None:
            return max_len - len(ids)
        if len(ids) + max_tokens > max_len:
            raise APIError(400, f"this model's maximum context length is {max_len} tokens, but {len(ids)} prompt "
                           f"tokens + {max_tokens} max_tokens were requested", param=max_param,
                           code="context_length_exceeded")
        return max_tokens

    async def submit(prompts: list[list[int]], budgets: list[int], req: _SamplingRequest, request: Request):
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        top_k = 0 if req.top_k in (None, -1) else req.top_k
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        gens: list[GenRequest] = []

        def make_sink(index: int):
            return lambda ev: loop.call_soon_threadsafe(queue.put_nowait, (index, ev))

        i = 0
        for ids, budget in zip(prompts, budgets):
            for j in range(req.n):
                seed = None if req.seed is None else req.seed + j
                gens.append(GenRequest(ids, budget, make_sink(i), temperature=temperature, top_k=top_k,
                                       top_p=top_p, seed=seed, stop=list(req.stop or ())))
                i += 1
        try:
            for g in gens:
                engine.submit(g)
        except QueueFull as e:
            for g in gens:
                engine.cancel(g)
            raise APIError(429, str(e), code="rate_limit_exceeded", type="rate_limit_error")
        except EngineStopped as e:
            for g in gens:
                engine.cancel(g)
            raise APIError(503, str(e), code="shutting_down", type="server_error")
        return gens, queue

    async def collect(gens: list[GenRequest], queue: asyncio.Queue, request: Request):
        texts = [[] for _ in gens]
        results: list[Finished | None] = [None] * len(gens)
        pending = len(gens)
        try:
            while pending:
                try:
                    index, ev = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        return None
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
            for g in gens:
                engine.cancel(g)
        if any(r.reason == "abort" for r in results):
            raise APIError(503, "the request was cancelled because the server is shutting down",
                           type="server_error", code="shutting_down")
        return ["".join(t) for t in texts], results

    def usage(results: Sequence[Finished], prompts: list[list[int]], n: int) -> dict[str, int]:
        p = sum(len(x) for x in prompts) * n
        c = sum(r.completion_tokens for r in results)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream_events(gens, queue, request, make_chunk, prompts, n, include_usage) -> AsyncIterator[str]:
        pending = len(gens)
        done: list[Finished] = []
        try:
            for idx in range(len(gens)):
                first = make_chunk(idx, None, None, first=True)
                if first is not None:
                    yield sse(first)
            while pending:
                index, ev = await queue.get()
                if isinstance(ev, Delta):
                    yield sse(make_chunk(index, ev.text, None))
                elif isinstance(ev, Finished):
                    pending -= 1
                    done.append(ev)
                    yield sse(make_chunk(index, ev.text, ev.reason))
                elif isinstance(ev, Failed):
                    pending -= 1
                    yield sse(_error_body(ev.message, "server_error", None, None))
            if include_usage:
                chunk = make_chunk(0, None, None)
                chunk["choices"] = []
                chunk["usage"] = usage(done, prompts, n)
                yield sse(chunk)
            yield "data: [DONE]\n\n"
        finally:  # normal end, or the client went away (the task is cancelled)
            for g in gens:
                engine.cancel(g)

    # ------------------------------------------------------------------ routes

    @app.get("/health")
    async def health():
        s = engine.stats()
        return {"status": "ok", "model": model_name, "method": loaded.method, **s}

    @app.get("/metrics")
    async def metrics_endpoint():
        s = engine.stats()
        metrics.queue_depth.set(s["waiting"])
        metrics.batch_occupancy.set(s["active"])
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "peagle-jax",
             "max_model_len": max_len}]}

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(req: CompletionRequest, request: Request):
        check_common(req)
        if req.echo:
            raise APIError(400, "echo is not supported by this server", param="echo", code="unsupported_parameter")
        if req.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix",
                           code="unsupported_parameter")
        if isinstance(req.prompt, str):
            prompts = [await run_in_threadpool(encode_text, req.prompt)]
        elif req.prompt and isinstance(req.prompt[0], str):
            prompts = [await run_in_threadpool(encode_text, p) for p in req.prompt]
        else:
            prompts = [list(req.prompt)]
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
        budgets = [check_prompt(p, req.max_tokens, "prompt", "max_tokens") for p in prompts]
        gens, queue = await submit(prompts, budgets, req, request)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index, text, reason, first=False):
            if first:
                return None
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}]}

        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream_events(gens, queue, request, chunk, prompts, req.n, include),
                                     media_type="text/event-stream")
        out = await collect(gens, queue, request)
        if out is None:
            return Response(status_code=499)
        texts, results = out
        return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": r.reason}
                            for i, (t, r) in enumerate(zip(texts, results))],
                "usage": usage(results, prompts, req.n)}

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_common(req)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value")
        try:
            ids = await run_in_threadpool(encode_chat, messages)
        except Exception as e:  # template errors (e.g. roles the template rejects)
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages", code="invalid_value")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        budget = check_prompt(ids, max_tokens, "messages", param)
        gens, queue = await submit([ids], [budget], req, request)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index, text, reason, first=False):
            if first:
                delta = {"role": "assistant", "content": ""}
            else:
                delta = {"content": text} if text else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                    "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream_events(gens, queue, request, chunk, [ids], req.n, include),
                                     media_type="text/event-stream")
        out = await collect(gens, queue, request)
        if out is None:
            return Response(status_code=499)
        texts, results = out
        return {"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                             "finish_reason": r.reason} for i, (t, r) in enumerate(zip(texts, results))],
                "usage": usage(results, [ids], req.n)}

    paths = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})
    app.add_middleware(_CountRequests, metrics=metrics, paths=paths)
    return app

"""Checks a request passes after schema validation: they need the served model (its names,
vocabulary, context length), so they cannot live in the pydantic request models."""

from __future__ import annotations

from peagle_jax.serve.context import ServerContext
from peagle_jax.serve.errors import APIError
from peagle_jax.serve.protocol import SamplingRequest

__all__ = ["check_model_and_options", "check_prompt_bytes", "prompt_budget"]


def check_model_and_options(req: SamplingRequest, model_aliases: frozenset[str]) -> None:
    """Reject a request for another model than `model_aliases` name, or for a setting this server
    would silently ignore."""
    if req.model is not None and req.model not in model_aliases:
        # 404 with code model_not_found, as OpenAI and vLLM answer an unknown model.
        raise APIError(404, f"model {req.model!r} is not served here; available: {sorted(model_aliases)}",
                       param="model", code="model_not_found")
    bad = req.unsupported()
    if bad:
        raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
    if req.return_draft_info and not req.stream:
        raise APIError(400, "return_draft_info reports each token as it streams: it needs stream: true",
                       param="return_draft_info", code="invalid_value")


def prompt_budget(ctx: ServerContext, ids: list[int], max_tokens: int | None, param: str, max_param: str) -> int:
    """The completion token budget for prompt `ids`: `max_tokens`, or all the context left when it
    is None. `param` and `max_param` name the request fields an error blames."""
    max_len, vocab_size = ctx.max_model_len, ctx.engine.vocab_size
    if not ids:
        raise APIError(400, f"{param} is empty", param=param, code="invalid_value")
    if any(not (0 <= t < vocab_size) for t in ids):
        raise APIError(400, f"{param} has token ids outside [0, {vocab_size})", param=param, code="invalid_value")
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


def check_prompt_bytes(ctx: ServerContext, text_bytes: int, param: str) -> None:
    """Refuse, before tokenizing it, a prompt of `text_bytes` bytes that cannot fit the context
    however it tokenizes (tokenizing 3.9 MB took seconds, to learn it did not fit)."""
    fewest = ctx.min_tokens(text_bytes)
    if fewest >= ctx.max_model_len:
        raise APIError(400, f"{param} is {text_bytes} bytes: at least {fewest} tokens, and this model's maximum "
                       f"context length is {ctx.max_model_len} tokens (prompt + completion)", param=param,
                       code="context_length_exceeded")

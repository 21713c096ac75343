"""OpenAI-compatible request bodies (strictly typed: "5" is not an integer here)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

Number = StrictFloat | StrictInt


MAX_TEMPERATURE = 100.0
INT32_MAX = 2**31 - 1
#: Bounds on a request's stop strings: the matcher's cost per token does not grow with them
#: (`detokenize.StopStrings`), but building it does, on the engine thread all requests share.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096


def _check_text(text: str, what: str) -> None:
    """Text must be valid Unicode: a lone surrogate (JSON's "\\ud800") cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} must be valid Unicode; found a lone surrogate at character {e.start}") from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions: model, budget and sampling."""

    # Unknown fields (user, metadata, ...) are accepted and ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, gt=0)
    # Bounded, so every value is finite in the engine's float32 arrays (OpenAI allows 0..2).
    temperature: Annotated[Number, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    # The engine holds top_k in int32; anything >= the vocabulary means "off" there anyway.
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] | None = None
    # Reproducible per request whatever shares its batch; the engine's key takes it mod 2**32.
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    # Per-request speculation (an extension, e.g. `extra_body` in the openai client): the drafts
    # this request may accept per round, 0 (off) up to the server's -k; omitted: the server's.
    num_speculative_tokens: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = None
    # Streams only (an extension): each chunk's choice also carries `draft_info`, its tokens'
    # texts and draft depths (responses.DraftToken), which the playground page highlights.
    return_draft_info: StrictBool = False
    # Accepted for compatibility; only the neutral values are supported (see `unsupported`).
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    logit_bias: Any = None
    best_of: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    repetition_penalty: Any = None
    stop_token_ids: Any = None
    top_logprobs: Any = None
    parallel_tool_calls: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        if len(v) > MAX_STOP_STRINGS or sum(map(len, v)) > MAX_STOP_CHARS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of {MAX_STOP_CHARS} characters in all are "
                             f"accepted, got {len(v)} of {sum(map(len, v))}")
        for s in v:
            _check_text(s, "stop strings")
        return v

    @property
    def stream_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (OpenAI sends one only when asked)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first setting this server would otherwise silently ignore.

        OpenAI and vLLM fields the engine does not implement are accepted only with their
        neutral value, so a client never gets an answer that quietly disregards its request.
        """
        for name, neutral in _NEUTRAL_VALUES.items():
            val = getattr(self, name)
            if val is not None and not any(val == v and type(val) is type(v) for v in neutral):
                shown = "".join(f", {v!r}" for v in neutral[:-1]) + (f" or {neutral[-1]!r}" if neutral else "")
                return name, f"{name} is not supported by this server (accepted: omitted, null{shown})"
        return None


#: Unimplemented request fields and the values that mean "off" (type-exact: True is not 1).
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logprobs": (False, 0),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "logit_bias": ({},),
    "best_of": (1,),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "stop_token_ids": ([],),
    "top_logprobs": (0,),
    "parallel_tool_calls": (),  # no tools are served, so no value of it can take effect
}


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictStr] | list[StrictInt]
    # OpenAI and vLLM default a completion to 16 tokens; null asks for all the context left.
    max_tokens: StrictInt | None = Field(16, gt=0)
    echo: StrictBool = False
    suffix: StrictStr | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        for p in [v] if isinstance(v, str) else v:
            if isinstance(p, str):
                _check_text(p, "prompt")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if isinstance(v, str):
            _check_text(v, "message content")
        elif isinstance(v, list):
            for part in v:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    _check_text(part["text"], "message content")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, gt=0)

    def token_limit(self) -> tuple[int | None, str]:
        """(limit, param): max_completion_tokens supersedes the deprecated max_tokens when given."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

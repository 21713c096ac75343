"""OpenAI-compatible response bodies, declared once so every endpoint and every SSE chunk
has the shape the official clients parse (field order matches OpenAI's too)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from peagle_jax.serve.engine import Finished
from peagle_jax.serve.output import TokenPiece

__all__ = [
    "ChatChoice", "ChatChunkChoice", "ChatChunks", "ChatCompletion", "ChatCompletionChunk", "ChatDelta",
    "ChatMessageOut", "ChunkFactory", "Completion", "CompletionChoice", "CompletionChunk", "CompletionChunks",
    "DraftToken", "Health", "ModelCard", "ModelList", "Speculation", "Usage",
]


def _is_none(value: object) -> bool:
    return value is None


class Speculation(BaseModel):
    """This request's speculative decoding, summed over its choices (an extension field: the
    official clients keep it, e.g. `usage.speculation` / `usage.model_extra` in `openai`)."""

    method: str
    num_draft_tokens: int  # K, the drafts proposed per round
    accepted_tokens: int  # drafts the target accepted
    target_forwards: int  # rounds after the prefill (one target forward each)
    acceptance_length: float  # tokens committed per target forward: 1 + accepted / forwards


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculation: Speculation | None = Field(None, exclude_if=_is_none)

    @classmethod
    def of(cls, prompt_tokens: int, results: Sequence[Finished], *, method: str = "none",
           num_draft_tokens: int = 0) -> Usage:
        completion = sum(r.completion_tokens for r in results)
        spec = None
        if method != "none":
            accepted = sum(r.accepted_tokens for r in results)
            forwards = sum(r.target_forwards for r in results)
            spec = Speculation(method=method, num_draft_tokens=num_draft_tokens, accepted_tokens=accepted,
                               target_forwards=forwards, acceptance_length=round(1 + accepted / max(forwards, 1), 4))
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion,
                   total_tokens=prompt_tokens + completion, speculation=spec)


class DraftToken(BaseModel):
    """One generated token in a stream with `return_draft_info` (an extension field of the
    chunk's choice; the official clients keep unknown fields)."""

    text: str  # the text its arrival released: a choice's tokens' texts join to its content
    depth: int  # d >= 1: the round's d-th draft, accepted by the target; 0: the target's own token


def draft_tokens(pieces: Sequence[TokenPiece] | None) -> list[DraftToken] | None:
    return None if pieces is None else [DraftToken(text=t, depth=d) for t, d in pieces]


class _Envelope(BaseModel):
    """The fields every completion object and chunk starts with (OpenAI's order)."""

    id: str
    object: str
    created: int
    model: str


# --------------------------------------------------------------------------- completions


class CompletionChoice(BaseModel):
    """One choice of a text completion; stream chunks carry the same shape with a text delta."""

    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None
    draft_info: list[DraftToken] | None = Field(None, exclude_if=_is_none)  # streams that asked for it


class Completion(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    # Only the final chunk of a stream with include_usage carries usage; others leave the key out.
    usage: Usage | None = Field(None, exclude_if=_is_none)


# --------------------------------------------------------------------------- chat completions


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None


class ChatCompletion(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """What a chat chunk adds to the message; keys with nothing to add are left out, as OpenAI does."""

    role: Literal["assistant"] | None = Field(None, exclude_if=_is_none)
    content: str | None = Field(None, exclude_if=_is_none)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None
    draft_info: list[DraftToken] | None = Field(None, exclude_if=_is_none)  # streams that asked for it


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_is_none)


# --------------------------------------------------------------------------- stream chunk factories


@runtime_checkable  # handlers' type hints are checked at run time in the tests (beartype)
class ChunkFactory(Protocol):
    """The response shapes of one endpoint: its stream chunks and its whole response, so one
    SSE loop and one respond path serve both endpoints."""

    def opening(self, index: int) -> BaseModel | None:
        """The chunk that starts choice `index` before any text, if the API sends one."""

    def piece(self, index: int, text: str, finish_reason: str | None,
              pieces: Sequence[TokenPiece] | None = None) -> BaseModel:
        """A stream chunk of choice `index`; `pieces`: its tokens' (text, depth), when asked for."""

    def usage(self, usage: Usage) -> BaseModel: ...

    def complete(self, texts: Sequence[str], reasons: Sequence[str], usage: Usage) -> BaseModel:
        """The whole response of a request that was not streamed."""


@dataclass(frozen=True)
class CompletionChunks:
    id: str
    created: int
    model: str

    def opening(self, index: int) -> None:
        return None  # text completions start straight with text

    def piece(self, index: int, text: str, finish_reason: str | None,
              pieces: Sequence[TokenPiece] | None = None) -> CompletionChunk:
        choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason, draft_info=draft_tokens(pieces))
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage(self, usage: Usage) -> CompletionChunk:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def complete(self, texts: Sequence[str], reasons: Sequence[str], usage: Usage) -> Completion:
        choices = [CompletionChoice(index=i, text=t, finish_reason=r)
                   for i, (t, r) in enumerate(zip(texts, reasons, strict=True))]
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


@dataclass(frozen=True)
class ChatChunks:
    id: str
    created: int
    model: str

    def _chunk(self, index: int, delta: ChatDelta, finish_reason: str | None,
               pieces: Sequence[TokenPiece] | None = None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, draft_info=draft_tokens(pieces))
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def opening(self, index: int) -> ChatCompletionChunk:
        # Clients build the message from deltas; the first one names the role.
        return self._chunk(index, ChatDelta(role="assistant", content=""), None)

    def piece(self, index: int, text: str, finish_reason: str | None,
              pieces: Sequence[TokenPiece] | None = None) -> ChatCompletionChunk:
        return self._chunk(index, ChatDelta(content=text or None), finish_reason, pieces)

    def usage(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def complete(self, texts: Sequence[str], reasons: Sequence[str], usage: Usage) -> ChatCompletion:
        choices = [ChatChoice(index=i, message=ChatMessageOut(content=t), finish_reason=r)
                   for i, (t, r) in enumerate(zip(texts, reasons, strict=True))]
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


# --------------------------------------------------------------------------- models and health


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "peagle-jax"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    """Liveness plus the engine's load figures (whatever `Engine.stats` reports, as extra keys)."""

    model_config = ConfigDict(extra="allow")

    status: Literal["ok"] = "ok"
    model: str
    method: str
    head: str | None = None  # the draft head's name (its folder), if the method uses one
    num_draft_tokens: int = 0  # K: drafts per round (0: no speculation); a request may ask for fewer
    adaptive: bool = False  # rounds speculate only where it measured faster (serve.adaptive)
    compiling: list[str] = []  # warm-up jobs still compiling in the background (requests that need one wait)

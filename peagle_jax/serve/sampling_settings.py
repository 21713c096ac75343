"""The one place a request's sampling fields become the engine's: completions and chat
completions must sample identically for the same settings."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from peagle_jax.serve.engine import GenRequest
from peagle_jax.serve.protocol import SamplingRequest

__all__ = ["SamplingSettings"]


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None  # None: the engine draws one
    stop: tuple[str, ...] = ()
    num_speculative_tokens: int | None = None  # None: the server's K
    draft_info: bool = False  # stream each token's draft depth (the return_draft_info extension)

    @classmethod
    def from_request(cls, req: SamplingRequest) -> SamplingSettings:
        """OpenAI's omitted fields and the -1 "off" of top_k resolved to the engine's neutral values."""
        return cls(
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            top_p=1.0 if req.top_p is None else float(req.top_p),
            seed=req.seed,
            stop=tuple(req.stop or ()),
            num_speculative_tokens=req.num_speculative_tokens,
            draft_info=req.return_draft_info,
        )

    def for_choice(self, choice: int) -> SamplingSettings:
        """Choice j of a seeded request samples with seed + j: the n choices differ, yet each is
        reproducible on its own."""
        return self if self.seed is None else dataclasses.replace(self, seed=self.seed + choice)

    def gen_request(self, prompt_ids: list[int], max_new_tokens: int, sink: Callable[[Any], None]) -> GenRequest:
        return GenRequest(prompt_ids, max_new_tokens, sink, temperature=self.temperature, top_k=self.top_k,
                          top_p=self.top_p, seed=self.seed, stop=list(self.stop),
                          num_speculative_tokens=self.num_speculative_tokens, draft_info=self.draft_info)

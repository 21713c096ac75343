"""What a caller hands the engine (`GenRequest`) and the errors `Engine.submit_all` raises.

A request also carries the engine's bookkeeping about it (its batch row, tokens so far, its
detokenizer and stop strings): the scheduler, the step runner and the output processor of
`serve.engine` each read and write their own part of it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from peagle_jax.serve.detokenize import IncrementalDetokenizer, StopStrings

__all__ = ["EngineStopped", "GenRequest", "QueueFull"]


class QueueFull(Exception):
    pass


class EngineStopped(Exception):
    pass


_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class GenRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sink: Callable[[Any], None]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    num_speculative_tokens: int | None = None  # drafts accepted per round, 0..K; None: the engine's K
    draft_info: bool = False  # also report each token's text and draft depth (`output.Delta.pieces`)
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    # engine-side state
    cancelled: bool = False
    slot: int | None = None
    first_token_time: float | None = None
    completion_tokens: int = 0
    output_ids: list[int] = dataclasses.field(default_factory=list)  # the tokens emitted, in order
    accepted_tokens: int = 0
    target_forwards: int = 0
    spec_rounds: int = 0  # speculative rounds in which it could accept drafts
    detok: IncrementalDetokenizer | None = None
    stopper: StopStrings | None = None
    finished: bool = False

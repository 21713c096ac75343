"""Incremental detokenization and stop strings for streaming.

Byte-level BPE splits a multi-byte UTF-8 character across tokens; decoding a prefix that ends
inside one yields U+FFFD. `IncrementalDetokenizer` keeps a small window of tokens (the vLLM /
HF TextStreamer scheme) and only releases text once it no longer ends in an incomplete
character, so every emitted delta is final and their concatenation equals the full decode.

`StopStrings` finds the first stop string in the generated text, truncates before it (the stop
string is not returned, as in OpenAI's API) and holds back any tail that could still become a
stop string, so a stream never shows text that a later token turns into a stop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], prompt_tail: Sequence[int] = ()):
        # Seeding the window with a few prompt tokens makes leading-space handling match
        # decoding in context; their own text is never emitted.
        self._decode = decode
        self.ids: list[int] = list(prompt_tail)
        self._prefix = 0
        self._read = len(self.ids)
        self._n_prompt = len(self.ids)

    @property
    def num_generated(self) -> int:
        return len(self.ids) - self._n_prompt

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        if len(full) > len(prefix_text) and not full.endswith(REPLACEMENT):
            delta = full[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return full[len(prefix_text) :] if len(full) > len(prefix_text) else ""


class StopStrings:
    """Tracks generated text against stop strings; hands out the text that is safe to send."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in (stops or ()) if s]
        self.text = ""  # generated text so far (truncated at the stop string once hit)
        self.sent = 0  # characters already released
        self.hit = False

    def add(self, delta: str) -> str:
        """Add text; returns the part that can be released now. Sets `hit` on a stop string."""
        if self.hit or not delta:
            return ""
        if not self.stops:
            self.text += delta
            self.sent = len(self.text)
            return delta
        start = max(0, len(self.text) - max(len(s) for s in self.stops) + 1)
        self.text += delta
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            self.text = self.text[: min(found)]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def flush(self) -> str:
        """At the end of generation, release everything held back."""
        return self._release(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out = self.text[self.sent : upto]
        self.sent = upto
        return out

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

from collections import deque
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


class _StopAutomaton:
    """Aho-Corasick over the stop strings: one step per generated character, whatever their
    number, where searching each string in the new text cost time per string per token (40,000
    stop strings stalled every stream in the batch: issue #49)."""

    def __init__(self, stops: Sequence[str]):
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.fail = [0]
        self.longest = [0]  # the longest stop string ending at this node (0: none)
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.fail.append(0)
                    self.longest.append(0)
                node = nxt
            self.longest[node] = len(stop)
        queue = deque(self.goto[0].values())
        while queue:  # breadth first: a node's failure link is shallower, so already final
            node = queue.popleft()
            for ch, child in self.goto[node].items():
                f = self.fail[node]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[child] = self.goto[f].get(ch, 0)
                self.longest[child] = self.longest[child] or self.longest[self.fail[child]]
                queue.append(child)

    def step(self, node: int, ch: str) -> int:
        while node and ch not in self.goto[node]:
            node = self.fail[node]
        return self.goto[node].get(ch, 0)


class StopStrings:
    """Tracks generated text against stop strings; hands out the text that is safe to send."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in (stops or ()) if s]
        self.text = ""  # generated text so far (truncated at the stop string once hit)
        self.sent = 0  # characters already released
        self.hit = False
        self._automaton = _StopAutomaton(self.stops) if self.stops else None
        self._node = 0  # the longest tail of `text` that begins a stop string

    def add(self, delta: str) -> str:
        """Add text; returns the part that can be released now. Sets `hit` on a stop string:
        of the stop strings that end in this delta, the one that starts first."""
        if self.hit or not delta:
            return ""
        if self._automaton is None:
            self.text += delta
            self.sent = len(self.text)
            return delta
        auto, node, first = self._automaton, self._node, None
        end = len(self.text)
        for i, ch in enumerate(delta):
            node = auto.step(node, ch)
            if auto.longest[node]:
                start = end + i + 1 - auto.longest[node]
                first = start if first is None else min(first, start)
        self.text += delta
        self._node = node
        if first is not None:
            self.hit = True
            self.text = self.text[:first]
            return self._release(len(self.text))
        return self._release(len(self.text) - auto.depth[node])

    def flush(self) -> str:
        """At the end of generation, release everything held back."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out = self.text[self.sent : upto]
        self.sent = upto
        return out

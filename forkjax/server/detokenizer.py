"""Incremental detokenization with stop strings, one instance per choice.

Text is decoded over a sliding window of ids (vLLM's prefix/read offsets), so a step costs the
window, not the whole output, and a multi-byte character split across tokens is only emitted
once complete. Text that could be the start of a stop string is held back until it is known
not to be one, so a stream never shows a stop string that the final answer cuts.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence ends with


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop  # the text ends with the stop string found
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (final for the consumed ids)
        self.emitted = 0  # len of the prefix of `text` already returned
        self.stopped = False  # a stop string was found: the choice is over
        self._prefix_offset = self._read_offset = 0

    def add(self, ids: list[int], final: bool) -> str:
        """Consume new token ids -> the text that may be shown now. After `final`, all of it."""
        self.ids += ids
        if self.tokenizer is None or self.stopped:
            return ""
        window = self.ids[self._prefix_offset:]
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(window)
        if final or (len(full) > len(prefix) and not full.endswith(REPLACEMENT)):
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._release(final)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if self.stop:
            longest = max(map(len, self.stop))
            start = max(0, self.emitted - longest + 1)
            hits = [(i, i + len(s) if self.include_stop else i)
                    for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
            if hits:
                end = min(hits)[1]
                self.text, self.stopped = self.text[:end], True
            elif not final:
                end -= self._stop_prefix_len(longest)
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out

    def _stop_prefix_len(self, longest: int) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        for k in range(min(longest - 1, len(self.text) - self.emitted), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

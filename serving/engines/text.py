"""Pure text assembly for engines: incremental detokenization with OpenAI `stop` strings."""
from __future__ import annotations

from typing import Callable, Sequence


class StopTextAssembler:
    """Turns generated token ids into text deltas, ending at the first `stop` string (excluded, as OpenAI does).

    Text that could still grow into a stop string is held back, so a stream never shows part of one.
    `decode(ids)` must decode the whole generated sequence (cumulative decoding keeps spacing right).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._emitted = 0
        self.text = ""
        self.stopped = False  # a stop string was found: generation should end

    @property
    def token_count(self) -> int:
        return len(self._ids)

    def add(self, token_id: int) -> str:
        """Feed one token; return the text that is now safe to show (may be empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        full = self._decode(self._ids)
        cut = min((i for i in (full.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = full[:cut]
        else:
            self.text = full[: len(full) - self._held_back(full)]
        delta = self.text[self._emitted:]
        self._emitted = max(self._emitted, len(self.text))
        return delta

    def flush(self) -> str:
        """Generation ended without a stop string: release what was held back."""
        if not self.stopped:
            self.text = self._decode(self._ids)
        delta = self.text[self._emitted:]
        self._emitted = len(self.text)
        return delta

    def _held_back(self, full: str) -> int:
        """Length of the longest suffix of `full` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(full)), longest, -1):
                if full.endswith(stop[:n]):
                    longest = n
                    break
        return longest

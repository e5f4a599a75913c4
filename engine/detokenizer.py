"""Incremental text of a completion, with stop strings, kept aligned with the token ids sent.

A chunk carries text and the ids that produced it. Text that may still change (an incomplete UTF-8
character) or may be the start of a stop string is held back together with its ids, so at every
chunk boundary "ids sent" and "text sent" agree: a stream resumed elsewhere from the ids sent
continues exactly after the text sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    stopped: bool = False  # a stop string was found; the text ends before it


@dataclass
class IncrementalText:
    decode: Callable[[list[int]], str]
    stop: tuple[str, ...] = ()
    resume_ids: list[int] = field(default_factory=list)
    _ids: list[int] = field(default_factory=list)
    _pending: list[int] = field(default_factory=list)
    _sent: int = 0  # characters of decode(resume + ids) already sent

    def __post_init__(self) -> None:
        self._ids = list(self.resume_ids)
        self._sent = len(self.decode(self._ids)) if self._ids else 0

    def add(self, token_ids: list[int], final: bool) -> Delta:
        self._ids += token_ids
        self._pending += token_ids
        text = self.decode(self._ids)
        for s in self.stop:
            # search from a little before what was sent: a stop string may straddle the boundary
            at = text.find(s, max(0, self._sent - len(s) + 1))
            if at != -1 and at + len(s) > self._sent:
                return self._flush(text[self._sent:max(at, self._sent)], stopped=True)
        if final:
            return self._flush(text[self._sent:])
        if text.endswith("\ufffd") or self._partial_stop(text):
            return Delta("", [])
        return self._flush(text[self._sent:])

    def _partial_stop(self, text: str) -> bool:
        tail = text[self._sent:]
        return any(tail.endswith(s[:k]) for s in self.stop for k in range(1, len(s)))

    def _flush(self, text: str, stopped: bool = False) -> Delta:
        ids, self._pending = self._pending, []
        self._sent += len(text)
        return Delta(text, ids, stopped)

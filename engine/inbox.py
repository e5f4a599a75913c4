"""What the event loop asks of the engine thread: typed messages and the one dispatch.

The HTTP side (``engine.async_engine``) puts messages on a queue; the engine thread applies them
between two steps. A message of any other type is a bug and is refused loudly, never guessed at.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Add:
    """Start generating ``seq``."""

    seq: Sequence


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop ``seq_id`` (its client went away); its blocks are freed."""

    seq_id: str


@dataclass(frozen=True, slots=True)
class Resize:
    """Resize the KV pool to ``budget`` bytes per rank; ``done`` (a future of the event loop) gets
    what it reached, or the error."""

    budget: int
    done: asyncio.Future


Message = Add | Abort | Resize


class Handler(Protocol):
    def add(self, seq: Sequence) -> None: ...
    def abort(self, seq_id: str) -> None: ...
    def resize(self, budget: int, done: asyncio.Future) -> None: ...


def dispatch(msg: Message, handler: Handler) -> None:
    match msg:
        case Add(seq):
            handler.add(seq)
        case Abort(seq_id):
            handler.abort(seq_id)
        case Resize(budget, done):
            handler.resize(budget, done)
        case _:
            raise TypeError(f"the engine inbox takes Add, Abort or Resize, not {msg!r}")

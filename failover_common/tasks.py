"""Background tasks, held until they end and stopped together.

The event loop keeps only weak references to tasks: one that nobody holds can be collected while it
runs. Each process component that starts work in the background (a probe, a claim, a respawn, a
client connection) holds it in a ``Tasks`` and ends it in its own ``stop``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any


class Tasks:
    __slots__ = ("_live",)

    def __init__(self) -> None:
        self._live: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """Run ``coro`` as a task named ``name`` (what a hung shutdown's report shows), held until it ends."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._live.add(task)
        task.add_done_callback(self._live.discard)
        return task

    def __iter__(self) -> Iterator[asyncio.Task]:
        return iter(list(self._live))

    def __len__(self) -> int:
        return len(self._live)

    async def stop(self, grace: float = 0.0, timeout: float | None = None) -> None:
        """Let the tasks finish for up to ``grace`` seconds, cancel those still running, and wait for
        them to end: at most ``timeout`` seconds if given (a task may refuse its cancellation)."""
        tasks = list(self._live)
        if grace > 0 and tasks:
            done, pending = await asyncio.wait(tasks, timeout=grace)
            _retrieve(done)
            tasks = list(pending)
        for t in tasks:
            t.cancel()
        if tasks:
            done, _ = await asyncio.wait(tasks, timeout=timeout)
            _retrieve(done)


def _retrieve(done: set[asyncio.Task]) -> None:
    """Take each ended task's exception, as gather(return_exceptions=True) would: stopping reports none,
    and none is reported later as never retrieved."""
    for t in done:
        if not t.cancelled():
            t.exception()

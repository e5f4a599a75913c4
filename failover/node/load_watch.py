"""The cache daemon's load as ``failover up`` shows it: the daemon's Status (its ``load`` field)
polled while the supervisor waits for the ready file, drawn as one bar on a terminal or logged as
``load_progress`` events when stderr is not one (failover_common.progress). The managed daemon runs
with ``--progress off``, so one process draws, on one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator

from cache_daemon import client
from cache_daemon.errors import CacheError
from failover_common.progress import LoadBar

POLL_S = 0.25


@contextlib.asynccontextmanager
async def shown(socket_path, label: str, stream=None, mode: str = "auto") -> AsyncIterator[LoadBar]:
    """Show the load while the body waits for the daemon to be ready; the bar's last state once it
    is (or its line ended, when the wait fails)."""
    bar = LoadBar(label, stream or sys.stderr, mode)
    task = asyncio.ensure_future(_watch(socket_path, bar))
    try:
        yield bar
    except BaseException:
        bar.abandon()
        raise
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    reply = await _status(socket_path)
    if reply is not None and reply.load is not None:
        bar.finish(reply.load.total, reply.load.seconds)
    else:
        bar.abandon()


async def _watch(socket_path, bar: LoadBar) -> None:
    """Feed ``bar`` from the daemon's status until cancelled; a daemon not listening yet is asked
    again at the next tick."""
    while True:
        reply = await _status(socket_path)
        if reply is not None and reply.load is not None:
            bar.update(reply.load.done, reply.load.total, reply.load.seconds)
        await asyncio.sleep(POLL_S)


async def _status(socket_path):
    if not client.socket_exists(socket_path):
        return None
    try:
        return await asyncio.to_thread(client.status, socket_path, timeout=1.0)
    except (CacheError, OSError):
        return None

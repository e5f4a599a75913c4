"""The batch runner: feeds a batch engine from a JSONL input and records every result durably.

The runner never owns the engine. It asks ``backend()`` for the URL of a ready batch engine and
waits there while the engine is preempted. A request cut off by an eviction (connection refused,
reset, or the engine dying mid-response) goes back to the queue and is sent again once the engine is
back; only a complete response is written. Results of greedy or seeded requests are therefore the
same as an uninterrupted run, and the output holds every id exactly once (see batch_io.ResultLog).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import aiohttp
import structlog

from failover.coserve.batch_io import BatchItem, ResultLog, error_record, result_record

log = structlog.get_logger(__name__)

BackendSource = Callable[[], Awaitable[str]]  # waits for, then returns, a ready engine's base URL


class EngineUnavailable(Exception):
    """503 from the engine: starting, draining or evicted; the request did not run."""


CUT_OFF = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError, EngineUnavailable)


@dataclass(slots=True)
class BatchProgress:
    total: int
    done: int = 0
    errors: int = 0
    in_flight: int = 0
    requeued: int = 0  # requests cut off by an eviction and sent again
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    done_at_start: int = 0

    def snapshot(self) -> dict:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = (self.done - self.done_at_start) / elapsed
        left = self.total - self.done
        return {
            "done": self.done, "total": self.total, "errors": self.errors, "in_flight": self.in_flight,
            "requeued": self.requeued, "tokens": self.tokens,
            "tokens_per_s": round(self.tokens / elapsed, 2),
            "eta_s": round(left / rate, 1) if rate > 0 else None,
        }


class BatchRunner:
    """Runs the items not yet in ``results`` against whatever engine ``backend()`` returns."""

    def __init__(self, items: list[BatchItem], results: ResultLog, *, concurrency: int = 4,
                 request_timeout: float = 600.0, max_attempts: int = 3,
                 on_record: Callable[[dict], None] | None = None, model: str | None = None) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.results = results
        self.model = model  # the batch engine serves one model: every request is sent with its name
        self.on_record = on_record  # called after each record is durable (the first after a resume is timed)
        self._requests: set[asyncio.Task] = set()  # requests in flight, cancelled by interrupt()
        self.concurrency = concurrency
        self.timeout = aiohttp.ClientTimeout(total=request_timeout)
        self.max_attempts = max_attempts  # for 5xx answers; cut-offs by eviction do not count
        self.progress = BatchProgress(total=len(items), done=sum(i.id in results.done for i in items))
        self.progress.done_at_start = self.progress.done
        self._queue: deque[BatchItem] = deque()
        for item in items:
            if item.id in results.done:
                continue
            if item.error:
                self._record(error_record(item), error=True)
            else:
                self._queue.append(item)
        self._attempts: dict[str, int] = {}

    def _record(self, record: dict, *, error: bool = False, tokens: int = 0) -> None:
        if record["id"] in self.results.done:
            return
        self.results.append(record)
        self.progress.done += 1
        self.progress.errors += error
        self.progress.tokens += tokens
        if self.on_record is not None:
            self.on_record(record)

    @property
    def remaining(self) -> int:
        return self.progress.total - self.progress.done

    def interrupt(self) -> int:
        """Cut off every request in flight now (an eviction follows): each goes back to the queue.

        Closing the connections first lets the engine's handlers end at once, so the SIGTERM that
        follows finds nothing in flight and the engine exits within its short deadline.
        """
        for task in self._requests:
            task.cancel()
        return len(self._requests)

    async def run(self, backend: BackendSource) -> dict:
        """Run until every item has a result; returns the final progress snapshot."""
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            workers = [asyncio.create_task(self._worker(session, backend)) for _ in range(self.concurrency)]
            try:
                await asyncio.gather(*workers)
            finally:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
        snap = self.progress.snapshot()
        log.info("batch_finished", **snap)
        return snap

    async def _worker(self, session: aiohttp.ClientSession, backend: BackendSource) -> None:
        while self._queue:
            item = self._queue.popleft()
            self.progress.in_flight += 1
            request = asyncio.ensure_future(self._run_one(session, backend, item))
            self._requests.add(request)
            try:
                await request
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # the runner itself is being stopped
                    raise
                self._queue.appendleft(item)  # interrupt(): cut off on purpose before an eviction
                self.progress.requeued += 1
            except CUT_OFF as e:
                # The engine went away under us (preempted or crashed): nothing was recorded, so the
                # item simply runs again on the next engine. Put it first to keep rough input order.
                self._queue.appendleft(item)
                self.progress.requeued += 1
                log.info("batch_request_cut_off", id=item.id, error=type(e).__name__)
                await asyncio.sleep(0.05)
            finally:
                self._requests.discard(request)
                self.progress.in_flight -= 1

    async def _run_one(self, session: aiohttp.ClientSession, backend: BackendSource, item: BatchItem) -> None:
        base = await backend()
        body = item.body if self.model is None else {**item.body, "model": self.model}
        async with session.post(base + item.url, json=body) as resp:
            if resp.status == 503:  # not a verdict on the request: it runs again once the engine is back
                raise EngineUnavailable(await resp.text())
            body = await resp.json(content_type=None)
        if resp.status >= 500:
            n = self._attempts[item.id] = self._attempts.get(item.id, 0) + 1
            if n < self.max_attempts:
                self._queue.append(item)
                return
        usage = body.get("usage") if isinstance(body, dict) else None
        tokens = (usage or {}).get("completion_tokens", 0)
        self._record(result_record(item, resp.status, body), error=resp.status >= 400, tokens=tokens)

"""The bridge between the aiohttp event loop and the engine thread.

The step loop runs in its own thread (the model's matmuls release the GIL) so the event loop keeps
answering /health, /metrics and new connections during a long step. Requests go in through a
thread-safe inbox; each step's outputs come back to per-request asyncio queues via
``call_soon_threadsafe``. A request whose consumer went away (client disconnect, cancellation) is
aborted, which frees its KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

import structlog

from engine.llm_engine import KVUsage, LLMEngine, RequestOutput
from engine.model_runner import StepPlan
from engine import inbox
from engine.sequence import Sequence

log = structlog.get_logger(__name__)
RESIZE_QUIET_S = 0.05  # an idle engine applies a pool resize after this long without work


class EngineDead(RuntimeError):
    """The engine thread failed; every in-flight request gets this, and the process exits."""


class AsyncEngine:
    """``build`` runs first on the engine thread (load weights, allocate KV, warm up), so every
    torch call of this rank, collectives included, happens on that one thread."""

    def __init__(self, build: Callable[[], LLMEngine], on_step: Callable[[int, int, KVUsage], None] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 on_graphs: Callable[[int], None] | None = None) -> None:
        self._build = build
        self.engine: LLMEngine | None = None
        self._ready: asyncio.Future | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}  # touched on the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._on_step, self._on_fatal, self._on_graphs = on_step, on_fatal, on_graphs
        self.graphs_captured = 0  # CUDA decode graphs captured so far (engine.cuda_graphs)
        self.graphs_total = 0  # buckets that will get one (0: eager decode only)
        self.error: BaseException | None = None
        self.kv_usage: KVUsage | None = None  # the engine thread's latest snapshot, for the probes
        self._resizes: list[tuple[int, asyncio.Future, float]] = []  # engine thread: (budget, done, asked at)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        # carry the caller's structlog context (process name) into the engine thread's log lines
        ctx = contextvars.copy_context()
        self._thread = threading.Thread(target=ctx.run, args=(self._run,), name="engine-step", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> LLMEngine:
        """The built engine; raises what ``build`` raised."""
        return await self._ready

    def stop(self, timeout: float = 10.0) -> None:
        """End the step loop (and, for tp > 1, the worker ranks). In-flight requests are dropped."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, req) -> AsyncIterator[RequestOutput]:
        """Outputs of one parsed request (``engine.protocol.GenerateRequest``), as the engine makes
        them; closing the iterator early aborts it."""
        if self.error is not None:
            raise EngineDead(str(self.error))
        seq = Sequence.from_request(req)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[seq.id] = stream
        self._inbox.put(inbox.Add(seq))
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise EngineDead(str(out))
                finished = out.finished
                yield out
        finally:
            self._streams.pop(seq.id, None)
            if not finished:
                self._inbox.put(inbox.Abort(seq.id))
                self._wake.set()

    async def resize_kv(self, budget: int) -> KVUsage:
        """Resize the KV pool between two steps (see ``LLMEngine.resize_kv``); returns what it reached."""
        if self.error is not None:
            raise EngineDead(str(self.error))
        done = self._loop.create_future()
        self._inbox.put(inbox.Resize(budget, done))
        self._wake.set()
        return await done

    # --- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._build()
        except BaseException as e:  # noqa: BLE001 - handed to the event loop, which reports and exits
            self._loop.call_soon_threadsafe(_settle, self._ready, None, e)
            return
        decoder = self.engine.runner.decoder
        self.graphs_total = len(decoder.pending) if decoder is not None else 0
        self._report()  # the pool's figures are there before the first request
        self._loop.call_soon_threadsafe(_settle, self._ready, self.engine, None)
        try:
            while not self._stopping:
                if self._drain_inbox():
                    self._report()
                if self.engine.runner.graphs_pending:  # one CUDA graph between two steps
                    self.engine.capture_graph()
                    self._report()
                    if not self.engine.has_work():
                        continue
                if not self.engine.has_work():
                    quiet = RESIZE_QUIET_S - (time.monotonic() - self._resizes[0][2]) if self._resizes else None
                    if quiet is not None and quiet <= 0:
                        self._apply_resizes()
                        continue
                    self._wake.wait(0.5 if quiet is None else quiet)
                    self._wake.clear()
                    continue
                outputs = self.engine.step(self._deliver_soon)
                self._loop.call_soon_threadsafe(self._deliver, outputs)
                self._report()
                self._apply_resizes()
                if self.engine.blocked():  # nothing fits until the pool grows: wait, never spin
                    self._wake.wait(0.5)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - any failure ends the engine; report, then exit
            log.exception("engine_step_failed")
            self.error = e
            self._loop.call_soon_threadsafe(self._fail_all, e)
            return
        for _, done, _ in self._resizes:  # asked for while stopping: never applied
            self._loop.call_soon_threadsafe(_settle, done, None, EngineDead("the engine is stopping"))
        try:
            self.engine.runner.run(StepPlan("stop"))
        except RuntimeError as e:  # a rank already gone: the process stop ends the others
            log.warning("tp_stop_failed", error=str(e))

    def _report(self) -> None:
        self.kv_usage = self.engine.kv_usage()
        if self.engine.runner.graphs_captured != self.graphs_captured:
            self.graphs_captured = self.engine.runner.graphs_captured
            if self._on_graphs is not None:
                self._on_graphs(self.graphs_captured)
        if self._on_step is not None:
            s = self.engine.scheduler
            self._on_step(len(s.running), len(s.waiting), self.kv_usage)

    def _drain_inbox(self) -> bool:
        """Apply queued messages (engine.inbox); True if there were any."""
        changed = False
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return changed
            changed = True
            inbox.dispatch(msg, self)

    # engine.inbox.Handler, on the engine thread
    def add(self, seq: Sequence) -> None:
        self.engine.add(seq)

    def abort(self, seq_id: str) -> None:
        self.engine.abort(seq_id)

    def resize(self, budget: int, done: asyncio.Future) -> None:
        # applied after the next step, or after RESIZE_QUIET_S without work: a promoted standby is
        # asked to grow as the streams it takes over arrive, and the growth (GiBs of KV, 40-110 ms
        # on an H200 while the dead primary's memory is being torn down) must not come first
        self._resizes.append((budget, done, time.monotonic()))

    def _apply_resizes(self) -> None:
        while self._resizes:
            budget, done, _ = self._resizes.pop(0)
            try:
                result, error = self.engine.resize_kv(budget), None
            except RuntimeError as e:  # out of memory: the pool stays as it was
                result, error = None, e
            self._report()  # metrics show the new pool by the time the caller hears back
            self._loop.call_soon_threadsafe(_settle, done, result, error)

    def _deliver_soon(self, outputs: list[RequestOutput]) -> None:
        self._loop.call_soon_threadsafe(self._deliver, outputs)

    # --- event loop ----------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.seq_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)
        if self._on_fatal is not None:
            self._on_fatal(error)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

"""Helpers for the router tests: real engines, an in-process router, load, and misbehaving backends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
from aiohttp import web

from conftest import Procs, free_port
from router.app import Router
from router.config import RouterConfig

PROMPTS = ["The quick brown fox", "A hot standby takes over", "one two three four", "Hello, world!"]
MAX_TOKENS = 32


# -- engines -----------------------------------------------------------------------------------
def start_engine(procs, model: Path, port: int) -> subprocess.Popen:
    return procs.python("-m", "failover.cli", "engine", "--model", str(model), "--weights", "disk",
                        "--port", str(port), "--device", "cpu", "--host", "127.0.0.1", "--served-model-name", "tiny",
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"engine behind {url} exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"engine behind {url} not ready within {timeout}s")


@dataclass
class Engine:
    name: str
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_engines(procs, model: Path, names: list[str]) -> list[Engine]:
    """Start engines in parallel (the CPU is the limit, not the waiting) and wait until all are ready."""
    engines = []
    for name in names:
        port = free_port()
        engines.append(Engine(name, port, start_engine(procs, model, port)))
    for e in engines:
        wait_ready(e.url, e.proc)
    return engines


@contextlib.contextmanager
def one_engine(model: Path):
    """One engine for a whole test module (its fixture), ended with its tree at the end."""
    procs = Procs()
    try:
        (e,) = start_engines(procs, model, ["eng"])
        yield e
    finally:
        procs.stop_all()


def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)


class KillLauncher:
    """A launcher over the test's own engine processes: fencing is SIGKILL (+SIGCONT for a stopped one)."""

    def __init__(self, engines: list[Engine], batch: frozenset[str] = frozenset()) -> None:
        self.engines = {e.name: e for e in engines}
        self.batch = batch
        self.fenced: list[str] = []
        self.standby_requests: list[str] = []
        self.preempted: list[str] = []
        self.resumed: list[str] = []

    async def fence(self, name: str) -> None:
        self.fenced.append(name)
        proc = self.engines[name].proc
        kill(proc, signal.SIGKILL)
        kill(proc, signal.SIGCONT)

    async def request_standby(self, service: str) -> None:
        self.standby_requests.append(service)

    def is_batch(self, service: str) -> bool:
        return service in self.batch

    async def preempt(self, service: str) -> None:
        self.preempted.append(service)

    async def resume(self, service: str) -> None:
        self.resumed.append(service)


def tolerant(**kw) -> RouterConfig:
    """A router config for tests that are not about probe timing: on a loaded 2-core machine an
    engine can miss two 0.25 s probes in a row, and a spurious failover would blur what they test."""
    return RouterConfig(**({"port": 0, "probe_timeout": 1.0, "failure_threshold": 3} | kw))


@contextlib.asynccontextmanager
async def running_router(config: RouterConfig, launcher=None, *, service: str = "tiny",
                         primary: Engine | str | None = None, standbys=()) -> AsyncIterator[Router]:
    """An in-process router (uvicorn's run_server style) on a free port, stopped afterwards."""
    router = Router(config, launcher)
    for role, items in (("primary", [primary] if primary is not None else []), ("standby", standbys)):
        for i, item in enumerate(items):
            if isinstance(item, Engine):
                router.add_instance(service, item.name, item.url, role, item.proc.pid)
            else:
                router.add_instance(service, f"{role}-{i}", item, role)
    await router.start()
    try:
        yield router
    finally:
        await router.stop()


async def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def counter(router: Router, name: str, **labels: str) -> float:
    """Sum of a metric's samples (optionally only those with ``labels``) from the router's registry."""
    total = 0.0
    for metric in router.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def client(router: Router) -> openai.AsyncOpenAI:
    # max_retries=0: every failure must be the router's to hide, not the SDK's.
    return openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)


# -- load and checking --------------------------------------------------------------------------
@dataclass
class Outcome:
    prompt: str
    stream: bool
    text: str
    token_ids: list[int]
    chat: bool = False


def _ids(choice) -> list[int]:
    return list((choice.model_extra or {}).get("token_ids") or [])  # our engine's extension field


async def complete(c: openai.AsyncOpenAI, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS,
                   midstream: set | None = None, chat: bool = False) -> Outcome:
    args = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0}
    create = c.chat.completions.create if chat else c.completions.create
    args |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    if not stream:
        ch = (await create(**args)).choices[0]
        return Outcome(prompt, False, ch.message.content if chat else ch.text, _ids(ch), chat)
    text, ids, ids_seen = "", [], set()
    s = await create(**args, stream=True)
    token = object()
    try:
        async for chunk in s:
            ids_seen.add(chunk.id)
            for ch in chunk.choices:
                text += (ch.delta.content if chat else ch.text) or ""
                ids += _ids(ch)
            if midstream is not None and ids:
                midstream.add(token)  # this stream is under way: a kill now must migrate it
    finally:
        if midstream is not None:
            midstream.discard(token)
    assert len(ids_seen) == 1, f"a migrated stream must keep one id, saw {ids_seen}"
    return Outcome(prompt, True, text, ids, chat)


async def reference(c: openai.AsyncOpenAI, prompts=PROMPTS, chat: bool = False) -> dict[str, Outcome]:
    """Greedy output of uninterrupted, non-streamed runs: what every interrupted one must equal."""
    outs = await asyncio.gather(*(complete(c, p, False, chat=chat) for p in prompts))
    return {o.prompt: o for o in outs}


async def references(c: openai.AsyncOpenAI) -> dict[tuple[str, bool], Outcome]:
    """References for what Load sends: every prompt as a completion and as a chat."""
    ref = {}
    for chat in (False, True):
        ref |= {(p, chat): o for p, o in (await reference(c, chat=chat)).items()}
    return ref


@dataclass
class Load:
    """Closed-loop clients (completions and chat, streamed and not); records every outcome and failure."""

    c: openai.AsyncOpenAI
    workers: int = 8
    outcomes: list[Outcome] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    midstream: set = field(default_factory=set)  # streams that got tokens and are not done
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.workers)]

    async def _worker(self, i: int) -> None:
        # worker i % 4: 0 streamed completion, 1 completion, 2 streamed chat, 3 chat
        n = 0
        while not self._stop.is_set():
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            try:
                self.outcomes.append(await complete(self.c, prompt, stream=i % 2 == 0, chat=i % 4 >= 2,
                                                    midstream=self.midstream))
            except (openai.APIError, AssertionError) as exc:
                self.errors.append(exc)
            n += 1

    async def until(self, count: int, timeout: float = 30.0) -> None:
        await wait_for(lambda: len(self.outcomes) + len(self.errors) >= count, timeout, f"{count} requests")

    async def streaming(self, count: int = 2, timeout: float = 30.0) -> None:
        """Wait until ``count`` streams are under way (so that a kill now catches them mid-stream)."""
        await wait_for(lambda: len(self.midstream) >= count, timeout, f"{count} streams under way")

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def check(self, ref: dict[tuple[str, bool], Outcome]) -> None:
        assert not self.errors, f"{len(self.errors)} failed requests, first: {self.errors[0]!r}"
        for o in self.outcomes:
            want = ref[(o.prompt, o.chat)]
            assert o.token_ids == want.token_ids, (
                f"{'stream' if o.stream else 'request'} for {o.prompt!r}: token ids differ from the "
                f"uninterrupted run\n got {o.token_ids}\nwant {want.token_ids}")
            assert o.text == want.text, f"text differs for {o.prompt!r}: {o.text!r} != {want.text!r}"


# -- misbehaving backends (small real servers in the test's loop) --------------------------------
@contextlib.asynccontextmanager
async def serve_raw(handler) -> AsyncIterator[str]:
    """``handler(reader, writer)`` on a raw socket at a free port: its URL."""
    port = free_port()
    server = await asyncio.start_server(handler, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def serve_app(app: web.Application, port: int) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _ready(request: web.Request) -> web.Response:
    return web.json_response({"ready": True})


def garbage_app() -> web.Application:
    """Answers /ready fine but every completion with a 200 that is not JSON."""
    async def completions(request: web.Request) -> web.Response:
        return web.Response(body=b"\x00\x01 this is not json", content_type="application/json")
    app = web.Application()
    app.add_routes([web.get("/ready", _ready), web.post("/v1/completions", completions)])
    return app


async def raw_garbage_server(port: int) -> asyncio.Server:
    """Not HTTP at all: whatever is sent, it answers noise and closes."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            await reader.read(65536)
            writer.write(b"SSH-2.0-not-an-engine\r\n\xff\xfe garbage\r\n\r\n")
            await writer.drain()
        writer.close()
    return await asyncio.start_server(handle, "127.0.0.1", port)


def stalling_app(first: Outcome, sent: int) -> web.Application:
    """Streams the first ``sent`` tokens of ``first`` (with their true ids), then stalls forever."""
    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        # The text of one token is not known here (no tokenizer), so chunks carry ids and no text;
        # the test compares token ids, which is what migration must get right.
        for i in range(sent):
            chunk = {"id": "cmpl-stall", "object": "text_completion", "created": 1, "model": "tiny",
                     "choices": [{"index": 0, "text": "", "token_ids": [first.token_ids[i]],
                                  "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await asyncio.sleep(3600)
        return resp
    app = web.Application()
    app.add_routes([web.get("/ready", _ready), web.post("/v1/completions", completions)])
    return app


async def under_load(router, workers: int) -> tuple[openai.AsyncOpenAI, dict, Load]:
    """A client of ``router``, the references of what Load sends, and ``workers`` clients started."""
    c = client(router)
    ref = await references(c)
    load = Load(c, workers=workers)
    load.start()
    return c, ref, load

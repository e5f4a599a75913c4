"""The OpenAI-compatible HTTP server (aiohttp) in front of the engine thread.

Lifecycle: the port opens first (``/health`` 200, ``/ready`` 503 "starting"), the engine thread
loads or maps the weights, allocates the KV cache and warms up, then ``/ready`` turns 200. On
SIGTERM the server drains (see ``EngineServer.drain``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import structlog
from aiohttp import web

from engine import admin_auth
from engine.async_engine import AsyncEngine, EngineDead
from engine.config import EngineConfig
from engine.metrics import EngineMetrics
from engine.protocol import ApiError, GenerateRequest, ServingContext, choice, envelope, parse_request, usage

log = structlog.get_logger(__name__)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every error leaves as ``{"error": {"message", "type", "param", "code"}}``."""
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        err = ApiError(e.status, e.reason or "error", type=kind, code=str(e.status))
        return web.json_response(err.body(), status=e.status)


class EngineServer:
    def __init__(self, cfg: EngineConfig, engine: AsyncEngine, metrics: EngineMetrics,
                 admin_token: bytes | None = None) -> None:
        self.cfg, self.engine, self.metrics = cfg, engine, metrics
        self.admin_token = admin_token  # None: every admin call is refused (engine/admin_auth.py)
        self.ctx: ServingContext | None = None  # set once the engine is built
        self.state = "starting"  # starting -> ready -> draining
        self.info: dict = {}
        self.app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[openai_errors])
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/ready", self.ready),
            web.get("/metrics", self.metrics_page),
            web.post("/admin/kv", self.grow_kv),
        ])

    def set_ready(self, ctx: ServingContext, info: dict) -> None:
        self.ctx, self.info, self.state = ctx, info, "ready"
        self.metrics.ready.labels(self.metrics.model).set(1)
        log.info("engine_ready", **info)

    async def drain(self, timeout: float) -> int:
        """Stop admitting (``/ready`` 503), then wait up to ``timeout`` s for in-flight requests.
        Returns how many were still running (they are dropped when the process stops)."""
        self.state = "draining"
        self.metrics.ready.labels(self.metrics.model).set(0)
        log.info("drain_started", in_flight=self.engine.in_flight, timeout=timeout)
        deadline = time.monotonic() + timeout
        while self.engine.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.engine.in_flight
        log.info("drain_finished", abandoned=left)
        return left

    # --- probes ---------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.engine.error is not None:
            return web.json_response({"status": "failed", "error": str(self.engine.error)}, status=503)
        return web.json_response({"status": "ok", "state": self.state})

    async def ready(self, request: web.Request) -> web.Response:
        if self.state != "ready" or self.engine.error is not None:
            return web.json_response({"ready": False, "state": self.state}, status=503)
        return web.json_response({"ready": True, **self.info, **self.engine.kv_usage.fields(),
                                  "cuda_graph_buckets": self.engine.graphs_captured,
                                  "cuda_graph_buckets_total": self.engine.graphs_total})

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "failover",
                "max_model_len": self.ctx.max_len if self.ctx else None}
        return web.json_response({"object": "list", "data": [card]})

    async def grow_kv(self, request: web.Request) -> web.Response:
        """``{"kv_memory": BYTES}``: resize the KV pool (per rank) towards that many bytes, growing or
        shrinking between two steps with sequences running. For a standby promoted into memory a dead
        primary or an evicted batch engine released, and for giving memory back. A shrink stops where
        a used block is in the way; the answer says what the pool reached. Needs the supervisor's
        bearer token."""
        admin_auth.check(request, self.admin_token)
        if self.state != "ready":
            raise ApiError(503, f"the engine is {self.state}", type="service_unavailable", code="not_ready")
        body = await _read_json(request, self.cfg.max_body_bytes)
        budget = body.get("kv_memory") if isinstance(body, dict) else None
        if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
            raise ApiError(400, "'kv_memory' must be a positive integer (bytes per rank)", param="kv_memory")
        try:
            kv = await self.engine.resize_kv(budget)
        except EngineDead as e:
            raise ApiError(500, f"the engine failed: {e}", type="server_error") from e
        except RuntimeError as e:
            raise ApiError(507, f"cannot grow the KV cache to {budget} bytes: {e}", type="server_error",
                           code="out_of_memory") from e
        log.info("kv_resized", requested=budget, bytes=kv.bytes, blocks=kv.blocks_total, used=kv.blocks_used)
        return web.json_response({"kv_memory_requested": budget, **kv.fields()})

    # --- generation -----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.state != "ready" or self.engine.error is not None:
            state = "failed" if self.engine.error is not None else self.state
            raise ApiError(503, f"the engine is {state}; retry on another instance",
                           type="service_unavailable", code="not_ready")
        req = parse_request(await _read_json(request, self.cfg.max_body_bytes), self.ctx, chat=chat)
        self.metrics.prompt_tokens.labels(self.metrics.model).inc(len(req.prompt_ids))
        try:
            if req.stream:
                return await self._stream(request, req)
            return await self._complete(req)
        except EngineDead as e:
            self.metrics.outcome("error")
            raise ApiError(500, f"the engine failed: {e}", type="server_error") from e

    async def _outputs(self, req: GenerateRequest):
        """The engine's outputs for ``req``, with latency metrics; nothing if the resumed tokens
        already used up ``max_tokens``."""
        if len(req.resume_ids) >= req.params.max_tokens:
            return
        start = last = time.monotonic()
        first = True
        async with contextlib.aclosing(self.engine.generate(req)) as outputs:
            async for out in outputs:
                now = time.monotonic()
                (self.metrics.ttft if first else self.metrics.itl).labels(self.metrics.model).observe(
                    now - (start if first else last))
                self.metrics.generation_tokens.labels(self.metrics.model).inc(out.new_tokens)
                first, last = False, now
                yield out

    async def _complete(self, req: GenerateRequest) -> web.Response:
        text, ids, reason, completion = [], [], "length", len(req.resume_ids)
        async with contextlib.aclosing(self._outputs(req)) as outputs:
            async for out in outputs:
                text.append(out.text)
                ids += out.token_ids
                reason, completion = out.finish_reason or reason, out.completion_tokens
        self.metrics.outcome(reason)
        body = envelope(req, self.cfg.model_name, [choice(req, "".join(text), ids, reason, chunk=False)],
                        chunk=False, usage_=usage(len(req.prompt_ids), completion))
        return web.json_response(body)

    async def _stream(self, request: web.Request, req: GenerateRequest) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        model, completion, reason = self.cfg.model_name, len(req.resume_ids), None

        def event(body: dict) -> bytes:
            return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

        async def send(body: dict) -> None:
            await resp.write(event(body))

        def chunk(text, ids, finish, first=False) -> dict:
            return envelope(req, model, [choice(req, text, ids, finish, chunk=True, first=first)],
                            chunk=True, usage_=None)

        try:
            if req.chat:
                await send(chunk("", [], None, first=True))
            tail = b""  # the finishing event (the last output: generate ends there), held to go
            # out in one write with [DONE] and the end
            async with contextlib.aclosing(self._outputs(req)) as outputs:
                async for out in outputs:
                    completion, reason = out.completion_tokens, out.finish_reason
                    if out.finished:
                        tail = event(chunk(out.text, out.token_ids, out.finish_reason))
                    elif out.text or out.token_ids:
                        await send(chunk(out.text, out.token_ids, out.finish_reason))
            if reason is None:  # resumed tokens had already used up max_tokens
                reason = "length"
                tail += event(chunk("", [], reason))
            if req.include_usage:
                tail += event(envelope(req, model, [], chunk=True, usage_=usage(len(req.prompt_ids), completion)))
            # one write, so a proxy reads the stream's end in one read: one wake-up less per stream
            await resp.write_eof(tail + b"data: [DONE]\n\n")
        except EngineDead as e:  # headers are sent: report in-band, then end the stream
            self.metrics.outcome("error")
            err = ApiError(500, f"the engine failed: {e}", type="server_error")
            await send(err.body())
            await resp.write_eof()
            return resp
        except (ConnectionResetError, asyncio.CancelledError) as e:
            # the client went away: closing the generator above aborted the sequence
            self.metrics.outcome("disconnect")
            log.info("client_disconnected", request=req.id)
            if isinstance(e, asyncio.CancelledError):
                raise
            return resp  # nothing to report to a peer that is gone (re-raising only logs a traceback)
        self.metrics.outcome(reason)
        return resp


async def _read_json(request: web.Request, limit: int):
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise ApiError(413, f"the request body is over {limit} bytes",
                       code="body_too_large") from e
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e

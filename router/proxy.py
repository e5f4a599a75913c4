"""The request path: pick the service, wait for its primary, forward, retry or migrate.

A request that has sent no byte to the client is simply re-sent (to whichever instance is primary
by then); a stream that has is migrated (router/stream.py). Non-streaming responses are read whole
before the client sees a byte, so always retryable. Every failed attempt goes to the promoter.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from router.answer_now import AnswerNow, Direct
from router.backend import Attempt, Instance, Recovery, Service
from router.body import BodyBudget, read_body
from router.config import RouterConfig
from router.errors import BackendFailed, BodyRejected, NoPrimary, Saturated
from router.forward import (MIGRATABLE_PATHS, RESPONSE_DROP, RETRY_STATUS, error_body,
                            forward_headers, is_json_object, parse_head)
from router.metrics import Metrics
from router.promotion import Promoter
from router.stream import ClientGone, StreamRelay
from router.stream_now import DirectStream
from router.upstream import ConnectError, ConnectTimeout, ProtocolError, Response

log = structlog.get_logger(__name__)

DRAIN_TIMEOUT = 0.5  # after [DONE]: how long the end of the upstream response may take to arrive
_UNREAD = object()


class Answered(web.StreamResponse):
    """``serve``'s return when router/front.py's listener already has the answer's bytes."""


ANSWERED = Answered()


class Proxy:
    def __init__(self, config: RouterConfig, services: dict[str, Service], promoter: Promoter,
                 metrics: Metrics, wake: Callable[[], None]) -> None:
        self.config = config
        self.wake = wake  # router/looplag.py LoopLag.wake: a request begins
        self.services = services
        self.promoter = promoter
        self.metrics = metrics
        self.bodies = BodyBudget(config.max_buffered_bytes)
        self._counters: dict[tuple[str, int], object] = {}  # metric children, per request: no labels()
        self._latency: dict[str, object] = {}
        self._reads: dict[str, tuple] = {}  # service -> stream_reads' (lane, parsed) children

    def pick(self, model: object) -> Service | None:
        """The service named by the request's ``model``, else the first service."""
        if isinstance(model, str) and model in self.services:
            return self.services[model]
        return next(iter(self.services.values()), None)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        # The raw path, exactly: aiohttp matched /v1/{tail} without resolving dot segments or
        # percent-escapes, and the client would resolve them on the way out (/v1/../admin/kv).
        path = request.rel_url.raw_path
        if path not in self.config.forward_paths:
            log.info("path_refused", method=request.method, path=request.raw_path[:200])
            return self._error(None, 404, f"Invalid URL ({request.method} {path[:200]}); the router "
                               f"forwards {', '.join(self.config.forward_paths)}", "invalid_request_error")
        # Built from the allow-listed constant, never from what the client sent.
        target = str(URL.build(path=path, query=request.rel_url.query))
        try:
            async with read_body(request, self.config, self.bodies) as body:
                return await self.serve(request, target, body, t0)
        except BodyRejected as exc:
            log.info("body_rejected", status=exc.status, path=path, why=str(exc))
            resp = self._error(None, exc.status, str(exc), exc.type)
            if exc.status == 503:
                resp.headers["Retry-After"] = str(self.config.retry_after_s)
            if exc.status == 408:
                # A stalled sender: answer, then close at once. aiohttp would otherwise linger up to
                # 10 s reading (and discarding) the rest of the body before closing.
                resp.force_close()
                await resp.prepare(request)
                await resp.write_eof()
                request.protocol.force_close()
            return resp

    def serve_now(self, request, body: bytes, t0: float, n: int):
        """router/front.py's plain request: a ``Direct`` already sent (a whole answer with a free
        primary and an idle connection: callbacks only, no task), else the ``serve`` coroutine to
        run in a task. ``n``: the body's bytes in the budget, given back when it ends."""
        head = parse_head(body)  # model, stream, n, echo: the prompt is skipped, not built
        service = self.pick(head.model if head is not None else None)
        relay = None
        if service is not None:
            if head is not None and head.stream is True:
                relay = StreamRelay(head, body, request, service.adapter)
                direct = DirectStream.start(self, request, service, relay, body, request.path, t0, n)
            else:
                direct = Direct.start(self, request, service, body, request.path, t0, n)
            if direct is not None:
                return direct
        return self.serve(request, request.path, body, t0, head, relay)

    async def serve(self, request: web.Request, target: str, body: bytes | bytearray,
                    t0: float, head=_UNREAD, relay: StreamRelay | None = None) -> web.StreamResponse:
        """One request whose path is allowed and whose body is read (aiohttp's ``handle`` above,
        or router/front.py's listener for a plain request). ``head``: its ``parse_head``, if read;
        ``relay``: a stream's, if built."""
        if head is _UNREAD:
            head = parse_head(body)  # model, stream, n, echo: the prompt is skipped, not built
        service = self.pick(head.model if head is not None else None)
        if service is None:
            return self._error(None, 503, "no service is configured", "service_unavailable")
        # a stream's dict is decoded only if it migrates (or its engine kind needs it at once)
        if relay is None and head is not None and head.stream is True:
            relay = StreamRelay(head, body, request, service.adapter)
        return await self._run(request, target, service, body, relay, t0, Recovery(service), None)

    async def carry_on(self, request, target: str, service: Service, body: bytes, t0: float,
                       recovery: Recovery, failure: BackendFailed | None,
                       relay: StreamRelay | None = None) -> web.StreamResponse:
        """A ``Direct`` or ``DirectStream`` (``relay``) whose attempt failed (``failure``, already
        counted) or never got a live connection (None): the task path from there on, as after its
        own failed attempt (a retry; a migration once the stream has started)."""
        return await self._run(request, target, service, body, relay, t0, recovery, failure)

    async def _run(self, request, target: str, service: Service, body: bytes | bytearray,
                   relay: StreamRelay | None, t0: float, recovery: Recovery,
                   failure: BackendFailed | None) -> web.StreamResponse:
        try:
            try:  # recovery: between a failed attempt and the next good byte
                return await self._attempts(request, target, service, body, relay, t0, recovery, failure)
            finally:
                recovery.end()
        except ClientGone:
            log.info("client_gone", service=service.name, path=request.path)
            self.metrics.requests.labels(service.name, "client_gone").inc()
            if relay is not None and relay.response is not None:
                return relay.response
            return web.Response(status=499)  # nobody is there to read it
        except asyncio.CancelledError:
            # handler_cancellation: a client that disconnects cancels this handler outright
            self.metrics.requests.labels(service.name, "client_gone").inc()
            raise

    async def _attempts(self, request: web.Request, target: str, service: Service, body: bytes | bytearray,
                        relay: StreamRelay | None, t0: float, recovery: Recovery,
                        failure: BackendFailed | None) -> web.StreamResponse:
        headers = getattr(request, "forward", None)  # router/front.py has them as bytes already
        if headers is None:
            headers = forward_headers(request.headers)
        if relay is not None:  # what the engine kind needs added to stream (ours: nothing, same bytes)
            body = relay.first_body(body)
        retries = migrations = 0
        while True:
            if failure is not None:  # the last attempt failed (counted): retry, migrate, or give up
                if relay is not None and relay.started:
                    if relay.finished:  # every token and the finish_reason are out: just close it
                        await relay.finish()
                        self.count_stream(service, relay, t0)
                        return relay.response
                    if not relay.can_migrate or migrations >= self.config.max_migrations:
                        why = f"not migratable ({relay.why_not})" if not relay.can_migrate else "too many migrations"
                        await relay.fail(f"upstream failed mid-stream and the stream is {why}: {failure}")
                        self.metrics.requests.labels(service.name, "stream_error").inc()
                        return relay.response
                    migrations += 1
                    relay.next_segment()
                    self.metrics.migrations.labels(service.name).inc()
                    log.info("stream_migrating", service=service.name, failed=failure.instance,
                             tokens_sent=len(relay.tokens), migration=migrations)
                else:
                    if retries >= self.config.max_retries:
                        return self._error(service, 502, f"every attempt failed; last: {failure}", "bad_gateway")
                    retries += 1
                    self.metrics.retries.labels(service.name).inc()
                failure = None
            inst = service.routable()  # the common case, without an await
            if inst is None or not inst.gate.try_enter():
                deadline = time.monotonic() + self.config.queue_deadline
                try:
                    inst = await service.acquire(deadline)
                    await inst.gate.enter(inst.name, deadline)
                except NoPrimary as exc:
                    return await self._no_primary(service, relay, exc)
                except Saturated as exc:
                    return await self._saturated(service, relay, exc)
            generation = inst.generation
            if inst.fenced or service.routable() is not inst:  # switched away while we queued: not a retry
                inst.gate.leave()
                continue
            if (relay is not None and relay.segment and inst.cut_leak
                    and not relay.cut.rewind(relay.tokens, getattr(relay.resume, "asked", False))):
                inst.gate.leave()  # this vLLM would begin the continuation with the prompt's text
                await relay.fail(f"upstream failed mid-stream inside a character, and {inst.name} would put the "
                                 "prompt's text into the continuation (its vLLM lacks the fix of vllm-project/vllm#48853; "
                                 "install failover in its environment)")
                self.metrics.requests.labels(service.name, "stream_error").inc()
                return relay.response
            path, send = relay.upstream(target, body) if relay is not None else (target, body)
            inst.begin()
            try:
                return await self._attempt(request, path, service, inst, send, headers, relay, t0, recovery)
            except BackendFailed as exc:
                failure = exc
                recovery.begin()
                self.promoter.passive_failure(inst, generation, exc.kind, exc.detail)
            finally:
                inst.end()
                inst.gate.leave()

    async def _attempt(self, request: web.Request, target: str, service: Service, inst: Instance,
                       body: bytes | bytearray, headers: bytes, relay: StreamRelay | None,
                       t0: float, recovery: Recovery) -> web.StreamResponse:
        session = inst.session(self.config.connect_timeout)
        attempt = Attempt()  # Instance.abort_inflight fires its guard when inst is fenced
        inst.attempts.add(attempt)
        self.wake()
        answer = getattr(request, "answer", None)  # router/front.py: the client's bytes first
        if answer is not None:  # and the task this runs in: no current_task() lookup in the guard
            attempt.guard.task = request.conn.task
        now = AnswerNow(answer, request.path, inst.name, attempt) if answer is not None and relay is None else None
        try:
            with attempt.guard:
                async with session.request(request.method, target, headers, body, now) as up:
                    if now is not None and now.sent:  # already answered, in the connection's callback
                        pass
                    elif up.status in RETRY_STATUS:
                        raise BackendFailed(inst.name, "unavailable", f"answered {up.status}")
                    elif relay is not None and up.status == 200 and up.content_type == "text/event-stream":
                        return await self._relay(service, inst, up, relay, attempt, t0, recovery)
                    data = await up.read()
                    if now is not None and now.sent:
                        pass
                    elif relay is not None and relay.started:
                        raise BackendFailed(inst.name, "rejected",
                                            f"resumed stream answered {up.status}: {data[:200]!r}")
                    elif up.status == 200 and request.path in MIGRATABLE_PATHS and not is_json_object(data):
                        raise BackendFailed(inst.name, "garbage", f"200 with a non-JSON body: {data[:80]!r}")
        except (BackendFailed, ClientGone):
            raise
        except TimeoutError as exc:  # before OSError, of which it is a subclass
            if attempt.stalled:
                raise BackendFailed(inst.name, "stall",
                                    f"no stream chunk within {self.config.stall_timeout}s") from exc
            if attempt.guard.expired():
                raise BackendFailed(inst.name, "fenced", "aborted: the instance was fenced") from exc
            # A connect that times out met a full listen backlog (or a slow network): saturated,
            # not dead; a dead engine refuses (ClientConnectorError below) or resets.
            kind = "slow" if isinstance(exc, ConnectTimeout) else "reset"
            raise BackendFailed(inst.name, kind, f"timeout: {exc!r}") from exc
        except ConnectError as exc:
            raise BackendFailed(inst.name, "connect", str(exc)) from exc
        except ProtocolError as exc:  # not HTTP: bad status line, bad headers
            raise BackendFailed(inst.name, "garbage", f"{type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            raise BackendFailed(inst.name, "reset", f"{type(exc).__name__}: {exc}") from exc
        except RuntimeError as exc:  # "Session is closed": fenced while we were about to send
            if not inst.fenced:
                raise
            raise BackendFailed(inst.name, "fenced", str(exc)) from exc
        finally:
            inst.attempts.discard(attempt)
        if answer is not None:
            if now is None or not now.sent:
                answer(up.status, up.client_lines(), inst.name, data)
            if up.status < 400:
                self.promoter.note_ok(inst)
            self.count(service, up.status, time.monotonic(), t0)
            return ANSWERED
        if up.status < 400:
            self.promoter.note_ok(inst)
        out = CIMultiDict((k, v) for k, v in up.headers if k.lower() not in RESPONSE_DROP)
        out["X-Failover-Instance"] = inst.name
        self.count(service, up.status, time.monotonic(), t0)
        return web.Response(status=up.status, body=data, headers=out)

    async def _relay(self, service: Service, inst: Instance, up: Response,
                     relay: StreamRelay, attempt: Attempt, t0: float, recovery: Recovery) -> web.StreamResponse:
        def first_ok() -> None:  # once per attempt: the failover's record and its settlement
            recovery.end()
            self.promoter.note_ok(inst)

        def mark_ok(now: float) -> None:  # per write: a timestamp, nothing else
            inst.last_ok = now

        attempt.watch(self.config.stall_timeout)
        try:
            await relay.pump(up.content, inst.name, attempt, mark_ok, first_ok)
        finally:
            attempt.unwatch()
        await relay.finish()  # [DONE] came: still disarmed, so a fence cannot cut the close
        self.count_stream(service, relay, t0)
        await _drain(up)
        return relay.response

    async def _no_primary(self, service: Service, relay: StreamRelay | None, exc: NoPrimary) -> web.StreamResponse:
        log.warning("no_primary", service=service.name, why=exc.why)
        return await self._unavailable(service, relay, exc)

    async def _saturated(self, service: Service, relay: StreamRelay | None, exc: Saturated) -> web.StreamResponse:
        log.debug("upstream_saturated", service=service.name, instance=exc.instance, why=exc.why)  # per request
        self.metrics.saturated.labels(service.name).inc()
        return await self._unavailable(service, relay, exc)

    async def _unavailable(self, service: Service, relay: StreamRelay | None, exc: Exception) -> web.StreamResponse:
        """503 with Retry-After, or, once a stream has started, its error event."""
        if relay is not None and relay.started:
            await relay.fail(str(exc))
            self.metrics.requests.labels(service.name, "stream_error").inc()
            return relay.response
        resp = self._error(service, 503, f"{exc}; retry shortly", "service_unavailable")
        resp.headers["Retry-After"] = str(self.config.retry_after_s)
        return resp

    def _error(self, service: Service | None, status: int, message: str, type_: str) -> web.Response:
        self._counter(service.name if service is not None else "-", status).inc()
        return web.json_response(error_body(message, type_, status), status=status)

    def count(self, service: Service, status: int, first_byte_at: float | None, t0: float) -> None:
        self._counter(service.name, status).inc()
        if first_byte_at is not None:
            hist = self._latency.get(service.name)
            if hist is None:
                hist = self._latency[service.name] = self.metrics.latency.labels(service.name)
            hist.observe(first_byte_at - t0)

    def count_stream(self, service: Service, relay: StreamRelay, t0: float) -> None:
        """``count`` for a stream answered in full, with how its reads were relayed."""
        self.count(service, 200, relay.first_byte_at, t0)
        reads = self._reads.get(service.name)
        if reads is None:
            reads = self._reads[service.name] = (self.metrics.stream_reads.labels(service.name, "lane"),
                                                 self.metrics.stream_reads.labels(service.name, "parsed"))
        reads[0].inc(relay.laned)
        reads[1].inc(relay.parsed)

    def _counter(self, service: str, status: int):
        """requests_total's child for (service, status), looked up once (labels() takes a lock and
        builds a tuple on every call; this runs once per request)."""
        child = self._counters.get((service, status))
        if child is None:
            child = self._counters[(service, status)] = self.metrics.requests.labels(service, str(status))
        return child


async def _drain(up: Response) -> None:
    """Read the stream's end (its last chunk follows [DONE]) so that the connection goes back to
    the instance's pool: released before its payload ended, it is closed, and the next request
    pays a connect on both sides. The client already has its whole answer; nothing is waited long."""
    if up.content.at_eof():
        return
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT):
            while await up.content.readany():
                pass
    except (TimeoutError, ProtocolError, OSError):
        pass  # the connection is closed instead of pooled: nothing lost

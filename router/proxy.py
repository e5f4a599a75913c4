"""The request path: pick the service, wait for its primary, forward, retry or migrate.

A request that has sent no byte to the client is simply re-sent (to whichever instance is primary
by then); a stream that has is migrated (router/stream.py). Non-streaming responses are read whole
before the client sees a byte, so always retryable. Every failed attempt goes to the promoter.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from router.backend import Attempt, Instance, Recovery, Service
from router.body import BodyBudget, read_body
from router.config import RouterConfig
from router.errors import BackendFailed, BodyRejected, NoPrimary, Saturated
from router.metrics import Metrics
from router.promotion import Promoter
from router.stream import MIGRATABLE_PATHS, ClientGone, StreamRelay
from router.upstream import ConnectError, ConnectTimeout, ProtocolError, Response

log = structlog.get_logger(__name__)

_decode = msgspec.json.Decoder().decode

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
                        "accept-encoding", "expect"})
# The body is forwarded decoded (router/body.py), so its coding must not be claimed upstream.
REQUEST_DROP = HOP_BY_HOP | {"content-encoding"}
RESPONSE_DROP = HOP_BY_HOP | {"server", "date", "content-encoding"}
# The engine says "not now" (starting, draining, overloaded): try the next primary.
RETRY_STATUS = frozenset({502, 503, 504})
DRAIN_TIMEOUT = 0.5  # after [DONE]: how long the end of the upstream response may take to arrive
REQUEST_DROP_B = frozenset(k.encode() for k in REQUEST_DROP)
RESPONSE_DROP_B = frozenset(k.encode() for k in RESPONSE_DROP)


class Answered(web.StreamResponse):
    """``serve``'s return when router/front.py's listener already has the answer's bytes."""


ANSWERED = Answered()


def error_body(message: str, type_: str, code: int) -> dict:
    return {"error": {"message": message, "type": type_, "code": code}}


class Proxy:
    def __init__(self, config: RouterConfig, services: dict[str, Service], promoter: Promoter,
                 metrics: Metrics) -> None:
        self.config = config
        self.services = services
        self.promoter = promoter
        self.metrics = metrics
        self.bodies = BodyBudget(config.max_buffered_bytes)
        self._counters: dict[tuple[str, int], object] = {}  # metric children, per request: no labels()
        self._latency: dict[str, object] = {}

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

    async def serve(self, request: web.Request, target: str, body: bytes | bytearray,
                    t0: float) -> web.StreamResponse:
        """One request whose path is allowed and whose body is read (aiohttp's ``handle`` above,
        or router/front.py's listener for a plain request)."""
        head = _parse_head(body)  # model and stream only: a whole request's prompt is skipped, not built
        service = self.pick(head.model if head is not None else None)
        if service is None:
            return self._error(None, 503, "no service is configured", "service_unavailable")
        payload = _parse(body) if head is not None and head.stream is True else None
        relay = StreamRelay(payload, request, service.adapter) if payload else None
        try:
            return await self._serve(request, target, service, body, relay, t0)
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

    async def _serve(self, request: web.Request, target: str, service: Service, body: bytes | bytearray,
                     relay: StreamRelay | None, t0: float) -> web.StreamResponse:
        recovery = Recovery(service)  # between a failed attempt and the next good byte
        try:
            return await self._attempts(request, target, service, body, relay, t0, recovery)
        finally:
            recovery.end()

    async def _attempts(self, request: web.Request, target: str, service: Service, body: bytes | bytearray,
                        relay: StreamRelay | None, t0: float, recovery: Recovery) -> web.StreamResponse:
        headers = getattr(request, "forward", None)  # router/front.py has them as bytes already
        if headers is None:
            headers = _forward_headers(request.headers)
        if relay is not None:  # what the engine kind needs added to stream (ours: nothing, same bytes)
            body = relay.first_body(body)
        retries = migrations = 0
        while True:
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
            if relay is not None and relay.started:
                if relay.finished:  # every token and the finish_reason are out: just close it
                    await relay.finish()
                    self._count(service, 200, relay.first_byte_at, t0)
                    return relay.response
                if not relay.can_migrate or migrations >= self.config.max_migrations:
                    why = f"not migratable ({relay.why_not})" if not relay.can_migrate else "too many migrations"
                    await relay.fail(f"upstream failed mid-stream and the stream is {why}: {failure}")
                    self.metrics.requests.labels(service.name, "stream_error").inc()
                    return relay.response
                migrations += 1
                relay.next_segment()
                self.metrics.migrations.labels(service.name).inc()
                log.info("stream_migrating", service=service.name, failed=inst.name,
                         tokens_sent=len(relay.tokens), migration=migrations)
            else:
                if retries >= self.config.max_retries:
                    return self._error(service, 502, f"every attempt failed; last: {failure}", "bad_gateway")
                retries += 1
                self.metrics.retries.labels(service.name).inc()

    async def _attempt(self, request: web.Request, target: str, service: Service, inst: Instance,
                       body: bytes | bytearray, headers: bytes, relay: StreamRelay | None,
                       t0: float, recovery: Recovery) -> web.StreamResponse:
        session = inst.session(self.config.connect_timeout)
        attempt = Attempt()  # Instance.abort_inflight fires its guard when inst is fenced
        inst.attempts.add(attempt)
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
                    elif up.status == 200 and request.path in MIGRATABLE_PATHS and not _is_json_object(data):
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
                answer(up.status, _answer_headers(up), inst.name, data)
            if up.status < 400:
                self.promoter.note_ok(inst)
            self._count(service, up.status, time.monotonic(), t0)
            return ANSWERED
        if up.status < 400:
            self.promoter.note_ok(inst)
        out = CIMultiDict((k, v) for k, v in up.headers if k.lower() not in RESPONSE_DROP)
        out["X-Failover-Instance"] = inst.name
        self._count(service, up.status, time.monotonic(), t0)
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
        self._count(service, 200, relay.first_byte_at, t0)
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

    def _count(self, service: Service, status: int, first_byte_at: float | None, t0: float) -> None:
        self._counter(service.name, status).inc()
        if first_byte_at is not None:
            hist = self._latency.get(service.name)
            if hist is None:
                hist = self._latency[service.name] = self.metrics.latency.labels(service.name)
            hist.observe(first_byte_at - t0)

    def _counter(self, service: str, status: int):
        """requests_total's child for (service, status), looked up once (labels() takes a lock and
        builds a tuple on every call; this runs once per request)."""
        child = self._counters.get((service, status))
        if child is None:
            child = self._counters[(service, status)] = self.metrics.requests.labels(service, str(status))
        return child


class AnswerNow:
    """A whole answer on router/front.py's listener, written in the upstream connection's callback
    (``Response.on_done``) once read and past ``_attempt``'s checks (no retry status; a completion's
    200 is a JSON object), before the task wakes. The attempt is then disarmed: a fence can no longer
    make it a retry (a second answer). Anything else, and a fenced attempt, is left to the task."""

    __slots__ = ("answer", "path", "instance", "attempt", "sent")

    def __init__(self, answer, path: str, instance: str, attempt: Attempt) -> None:
        self.answer, self.path, self.instance, self.attempt, self.sent = answer, path, instance, attempt, False

    def __call__(self, up: Response) -> None:
        attempt = self.attempt
        if attempt.aborted or up.status in RETRY_STATUS:
            return
        data = up.body()
        if up.status == 200 and self.path in MIGRATABLE_PATHS and not _is_json_object(data):
            return
        attempt.disarm()
        try:
            self.answer(up.status, _answer_headers(up), self.instance, data)
        except Exception:  # never into the parser's callback: the task answers instead
            log.exception("answer_failed", instance=self.instance)
            attempt.rearm()
            return
        self.sent = True


def _answer_headers(up: Response) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in up.raw_headers if k.lower() not in RESPONSE_DROP_B]

class _Head(msgspec.Struct):  # what the proxy reads of every request body; the rest is skipped unbuilt
    model: object = None
    stream: object = None


_decode_head = msgspec.json.Decoder(_Head).decode


def _parse_head(body: bytes | bytearray) -> _Head | None:
    """``model`` and ``stream`` of a JSON object request, or None (malformed: to the engine as is)."""
    if not body or body[:1] not in (b"{", b" ", b"\n", b"\t", b"\r"):
        return None
    try:
        return _decode_head(body)
    except msgspec.DecodeError:  # and ValidationError (not an object)
        return None


def _parse(body: bytes | bytearray) -> dict | None:
    """The JSON object of a request, or None (malformed bodies go to the engine unchanged)."""
    if not body or body[:1] not in (b"{", b" ", b"\n", b"\t", b"\r"):
        return None
    try:
        obj = _decode(body)
    except msgspec.DecodeError:
        return None
    return obj if isinstance(obj, dict) else None


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


def _is_json_object(data: bytes) -> bool:
    try:
        return isinstance(_decode(data), dict)
    except msgspec.DecodeError:
        return False


FORWARD_TAIL = b"Accept-Encoding: identity\r\n"  # we parse streams; the client link may compress later


def _forward_headers(headers) -> bytes:
    """The client's end-to-end headers as request header lines for router/upstream.py (each
    ending in CRLF; values as aiohttp's parser accepted them, so with no CR or LF in them).
    router/front.py builds the same lines from the raw head (``FastRequest.forward``)."""
    lines = [f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() not in REQUEST_DROP]
    return "".join(lines).encode("latin-1") + FORWARD_TAIL

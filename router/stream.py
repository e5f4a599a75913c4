"""One client's SSE stream, relayed across however many upstream attempts it takes.

Hot path (issue 20): the client gets the upstream's bytes unchanged, one write per upstream read
(all the whole events it holds). The common read, one chunk of one event, takes the lane
(router/sse.py): sent as it came, framing and all, its event inspected only when its ids are
needed (a break, the next parsed read, or ``HELD_MAX`` reads later). Any other read is parsed
(httptools, then ``_scan``). The service's ``Resume`` adapter (router/resume.py) decodes an event
only as far as migration needs: ids, text carried, ``finish_reason``. Per read only a timestamp
besides (stall watchdog, ``last_ok``); the promoter's bookkeeping runs once per attempt.

Migration: the relay remembers the token ids of every event it forwarded. When the upstream breaks
after the client got tokens, the adapter's ``resume_body`` re-issues the request continuing after
exactly those ids; the engine generates only the remainder, so the client sees no repeated and no
missing token. Events of a resumed segment are rewritten by ``continuation`` (the original
``id``/``created``, the role-only opening chunk dropped). A kind whose events carry no ids makes the
stream non-migratable: it is retried only before its first byte.

Comments (keep-alives) are forwarded only between data events of one read, never on their own
(no 200 is committed on a keep-alive, and one does not count as a good byte); upstream CRLF line
ends are normalised to LF. Those are the only differences from the engine's own bytes in a first
segment.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
from aiohttp import web

from router.cut import CutPoint
from router.errors import BackendFailed
from router.forward import MIGRATABLE_PATHS, parse
from router.sse import data_of, event_data, one_event
from router.resume import BUNDLED, Resume, Seen, inspect_dict

_encode = msgspec.json.Encoder().encode
_inspect = inspect_dict  # the dict form, for callers that hold a decoded event
# Lane reads a relay sends before it inspects them (``_settle``): a break then finds at most this
# many events to decode, and a long stream holds at most this many reads.
HELD_MAX = 32
__all__ = ["MIGRATABLE_PATHS", "ClientGone", "Seen", "StreamRelay"]


class ClientGone(Exception):
    """The client went away while we wrote to it; nothing to retry, nothing to report."""


class _Stop(Exception):
    """StreamRelay._on_chunk: hand back to pump."""


class StreamRelay:
    """``head``: the request's router/forward.py ``Head``; ``raw``: its body. The body's whole dict
    (``payload``) is decoded only when needed: our engine's streams need it only to migrate."""

    def __init__(self, head, raw: bytes | bytearray, request: web.Request, adapter=None) -> None:
        self.raw = raw
        self._payload: dict | None = None
        self.request = request
        # the engine kind's per-stream migration (router/adapters); None: our engine's (router/resume.py)
        self.resume: Resume = adapter.stream(self.payload, request.path) if adapter is not None else BUNDLED
        self._can_migrate = request.path in MIGRATABLE_PATHS and head.n in (1, None) and not head.echo
        self.why_not = "no token_ids" if adapter is None else "the engine's events cannot be continued exactly"
        if adapter is not None and not self.resume.resumable:
            self._can_migrate, self.why_not = False, self.resume.why_not
        self._tokens: list[int] = []  # ids already sent to the client, all segments (``tokens``)
        self.cut = CutPoint()  # where a continuation on a vLLM that leaks a cut prompt may start
        self._held: list[bytes] = []  # reads the lane sent, not yet inspected (``_settle``)
        self.laned = self.parsed = 0  # upstream reads sent by the lane / by the parse (``_feed``)
        self.segment = 0  # 0: the first upstream attempt; >0: a migrated continuation
        self.first_id = self.created = None
        self._finished = False  # a finish_reason was forwarded (``finished``)
        self.done = False  # [DONE] forwarded
        self.response: web.StreamResponse | None = None
        self.first_byte_at: float | None = None  # monotonic, for the latency histogram
        # the attempt being pumped: (instance, attempt, mark_ok, first_ok, content), and its read state
        self._att: tuple | None = None
        self._buf, self._seen, self._first, self._exc = b"", [], True, None

    @property
    def payload(self) -> dict:
        """The request's JSON object (decoded on first use; ``head`` said it is one)."""
        if self._payload is None:
            self._payload = parse(self.raw)
            assert self._payload is not None, "a stream's body decoded as a Head but not as an object"
        return self._payload

    @property
    def tokens(self) -> list[int]:
        """The token ids the client has, all segments, in order."""
        self._settle()
        return self._tokens

    @property
    def finished(self) -> bool:
        """A finish_reason has reached the client."""
        self._settle()
        return self._finished

    @property
    def can_migrate(self) -> bool:
        """A break now could be continued exactly (``why_not`` says why not)."""
        self._settle()
        return self._can_migrate

    @property
    def started(self) -> bool:
        return self.response is not None

    def resume_body(self) -> bytes:
        """The original request continued after the tokens already streamed (same budget)."""
        return self.resume.resume_body(self.payload, self.tokens)

    def first_body(self, raw: bytes | bytearray) -> bytes | bytearray:
        """The first attempt's body: what the engine kind needs added (ours: nothing, same bytes)."""
        if self.resume is BUNDLED:
            return raw  # the engine sends token ids unasked: the client's bytes as they are, no decode
        return self.resume.first_body(self.payload, raw)

    def upstream(self, target: str, body: bytes | bytearray) -> tuple[str, bytes | bytearray]:
        """The path and body of the next attempt: the first segment's, or a continuation's."""
        if self.segment == 0:
            return target, body
        return self.resume.resume_path(target), self.resume_body()

    async def _start(self, instance: str) -> None:
        """Send the client our 200 and SSE headers: only once a valid first event is in hand."""
        if getattr(self.request, "open_stream", None) is not None:  # router/front.py's lean listener
            self._open(instance)
            return
        resp = web.StreamResponse(status=200, headers=self._headers(instance))
        try:
            await resp.prepare(self.request)
        except ConnectionError as exc:
            raise ClientGone() from exc
        self.response = resp
        self.first_byte_at = time.monotonic()

    def _open(self, instance: str) -> None:
        """``_start`` on the lean listener, where it needs no await."""
        try:
            resp = self.request.open_stream(self._headers(instance))
        except ConnectionError as exc:
            raise ClientGone() from exc
        self.response = resp
        self.first_byte_at = time.monotonic()

    @staticmethod
    def _headers(instance: str) -> dict:
        return {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Failover-Instance": instance}

    async def write(self, data: bytes) -> None:
        assert self.response is not None
        try:
            await self.response.write(data)
        except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one
            raise ClientGone() from exc

    async def finish(self) -> None:
        """End the client's stream cleanly (upstream sent [DONE], or ended after a finish_reason)."""
        if not self.done:
            self.done = True
            await self.write(b"data: [DONE]\n\n")
        try:
            await self.response.write_eof()
        except ConnectionError as exc:
            raise ClientGone() from exc

    async def fail(self, message: str) -> None:
        """The stream cannot be continued: an error event (the OpenAI SDK raises APIError on it)."""
        err = {"error": {"message": message, "type": "backend_failed", "code": 502}}
        await self.write(b"data: " + _encode(err) + b"\n\n")
        try:
            await self.response.write_eof()
        except ConnectionError as exc:
            raise ClientGone() from exc

    def next_segment(self) -> None:
        self._settle()
        self.segment += 1

    async def pump(self, content, instance: str, attempt, mark_ok: Callable[[float], None],
                   first_ok: Callable[[], None]) -> None:
        """Relay one upstream attempt until its [DONE] (returns, ``self.done``; the caller then calls
        ``finish``) or its end (BackendFailed reset). ``attempt`` (backend.Attempt) is disarmed
        around each client write and its stall watchdog fed per read; ``mark_ok(now)`` runs per
        write (a timestamp), ``first_ok()`` once, after this attempt's first write.

        On router/front.py's listener with router/upstream.py's response (``content.sink``), each
        upstream read is relayed in the connection's own callback (``_on_chunk``: scan, client
        write, record, all synchronous), not by waking this coroutine: it waits only for what the
        callback cannot do (the end, an error, a client that is not reading)."""
        self.attach(content, instance, attempt, mark_ok, first_ok)
        sink = (hasattr(content, "sink") and getattr(self.request, "open_stream", None) is not None)
        while True:
            if sink and content.can_sink():
                content.sink = self._on_chunk
                try:
                    while content.sink is not None and not content.complete and content.error is None:
                        await content.changed()
                finally:
                    content.sink = None
                exc, self._exc = self._exc, None
                if exc is not None:
                    raise exc
                if self.done:
                    return  # still disarmed: finish() must not be cut
                if not attempt.armed:  # the client stopped reading: wait for it, disarmed as in write()
                    try:
                        await self.response.conn.drain()
                    except ConnectionError as exc:
                        raise ClientGone() from exc
                if not attempt.rearm():
                    kind = "stall" if attempt.stalled else "fenced"
                    raise BackendFailed(instance, kind, f"aborted: {kind}")
                continue  # or the response ended / failed: readany says which
            chunk = await content.readany()
            if not chunk:
                raise BackendFailed(instance, "reset", "stream ended before [DONE]")
            attempt.last = now = time.monotonic()
            out = self._feed(chunk, instance)
            if not out:
                continue
            if not self.started:
                await self._start(instance)
            attempt.disarm()  # the client write: an abort now is seen at rearm(), after it
            await self.write(out)
            # Only now is it the client's: an abort during the write must not count these tokens as sent.
            self._sent(now)
            if self.done:
                return  # still disarmed: finish() must not be cut
            if not attempt.rearm():
                kind = "stall" if attempt.stalled else "fenced"
                raise BackendFailed(instance, kind, f"aborted: {kind}")

    def attach(self, content, instance: str, attempt, mark_ok: Callable[[float], None],
               first_ok: Callable[[], None]) -> None:
        """The upstream attempt this relay reads from now (``pump``'s arguments); router/stream_now.py
        drives ``on_chunk`` itself, with no coroutine."""
        self._settle()  # the last attempt's reads, named after it
        self._att = (instance, attempt, mark_ok, first_ok, content)
        self._buf, self._first, self._exc = b"", True, None
        if (self.segment == 0 and not self.resume.rewrites_first and getattr(content, "chunked", False)
                and getattr(self.request, "open_stream", None) is not None):
            content.lane = self._lane  # router/upstream.py offers it each read while this relay is the sink

    def take_error(self):
        """What made ``on_chunk`` hand back (BackendFailed, ClientGone), or None; cleared."""
        exc, self._exc = self._exc, None
        return exc

    def on_chunk(self, chunk: bytes) -> None:
        self._on_chunk(chunk)

    def _on_chunk(self, chunk: bytes) -> None:
        """``pump``'s work for one upstream read, in router/upstream.py's ``on_body`` callback. No
        await between the client write and the record of its tokens, so no abort falls between
        them. Anything the callback cannot finish (the end, an error, a paused client) hands back
        to ``pump``: ``content.sink = None`` and a wake-up."""
        instance, attempt, _, _, content = self._att
        try:
            if attempt.aborted:  # the guard fired: pump is being cancelled; relay nothing more
                raise _Stop()
            attempt.last = now = time.monotonic()
            out = self._feed(chunk, instance)
            if not out:
                return
            if not self.started:
                self._open(instance)
            try:
                paused = self.response.send(out, self.done)  # [DONE]: the stream's end in the same write
            except ConnectionError as exc:
                raise ClientGone() from exc
            self._sent(now)
            if self.done or paused:
                attempt.disarm()  # done: finish() must not be cut; paused: pump drains, then re-arms
                raise _Stop()
            return
        except _Stop:
            pass
        except BaseException as exc:  # BackendFailed (garbage), ClientGone: pump raises it
            self._exc = exc
        content.unsink()

    def _lane(self, data: bytes) -> bool:
        """``_on_chunk`` for a read of one chunk of one event (router/sse.py), offered before httptools
        sees it, once the first segment has started and nothing is held back: sent as it came, its
        event inspected when its ids are needed (``_settle``). False: the usual path takes it."""
        instance, attempt, mark_ok, _, content = self._att
        if not one_event(data) or attempt.aborted or self._buf or self.response is None:
            return False
        try:
            paused = self.response.send_chunk(data)
        except ConnectionError:
            return False
        attempt.last = now = time.monotonic()
        held = self._held
        held.append(data)
        self.laned += 1
        mark_ok(now)
        if len(held) >= HELD_MAX:
            self._settle()
        if paused:
            attempt.disarm()  # as _on_chunk: the coroutine (or stream_now) drains, then re-arms
            content.unsink()
        return True

    def _settle(self) -> None:
        """Inspect the lane's reads, in order. One that does not inspect (garbage the engine sent,
        which the client has) makes the stream not migratable, naming it. Nothing held: nothing."""
        if not self._held:
            return
        held, self._held = self._held, []
        instance = self._att[0] if self._att is not None else "?"
        for data in held:
            try:
                s = self.resume.inspect(event_data(data), instance)
            except BackendFailed as exc:
                self._can_migrate, self.why_not = False, f"an event sent as it came is not one: {exc.detail}"
                continue
            self._record(s)

    def _record(self, s: Seen) -> None:
        self._tokens += s.ids
        self.cut.note(s, len(self._tokens))
        self._finished = self._finished or s.finished
        if not s.migratable:
            self._can_migrate = False

    def _feed(self, chunk: bytes, instance: str) -> bytes:
        """One upstream read into the event buffer: the bytes to send for the whole events it
        completed (b"" if none, or only comments), their ``Seen`` kept for ``_sent``."""
        self.parsed += 1
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in chunk:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        events, self._buf = buf[:end + 2], buf[end + 2:]
        out, self._seen = self._scan(events, instance)
        return out

    def _sent(self, now: float) -> None:
        """The bytes of the last ``_feed`` are the client's: record their tokens."""
        self._settle()  # the lane's reads came first
        for s in self._seen:
            self._record(s)
        _, _, mark_ok, first_ok, _ = self._att
        mark_ok(now)
        if self._first:
            self._first = False
            first_ok()

    def _scan(self, events: bytes, instance: str) -> tuple[bytes, list[Seen]]:
        """The bytes to send for ``events`` (whole events, each ending in a blank line) and what
        each data event carried; sets ``done`` on [DONE] (anything after it is dropped)."""
        seen: list[Seen] = []
        pieces: list[bytes] = []  # rewritten events (a continuation's, or a first segment's that the kind rewrites)
        first_seg = self.segment == 0 and not self.resume.rewrites_first  # bytes go out unchanged
        skip = 0  # first segment: leading comments before the stream started are not sent
        pos, n = 0, len(events)
        while pos < n:
            end = events.index(b"\n\n", pos)
            event, pos = events[pos:end], end + 2
            data = data_of(event)
            if data is None:  # comment / keep-alive
                if first_seg and not self.started and not seen:
                    skip = pos
                continue
            if data == b"[DONE]":
                if not self.started and not seen and not pieces:
                    raise BackendFailed(instance, "garbage", "[DONE] before any event")
                self.done = True
                if first_seg:
                    return events[skip:pos], seen
                pieces.append(b"data: [DONE]\n\n")
                return b"".join(pieces), seen
            s = self.resume.inspect(data, instance)
            if first_seg:
                if self.first_id is None and not seen:
                    self.first_id, self.created = self.resume.head(data)
                seen.append(s)
            elif self.segment == 0:  # a first segment the engine kind rewrites for the client
                if self.first_id is None and not seen:
                    self.first_id, self.created = self.resume.head(data)
                pieces.append(b"data: " + self.resume.client_event(data, instance) + b"\n\n")
                seen.append(s)
            else:
                out = self.resume.continuation(data, self.first_id, self.created, instance)
                if out is not None:
                    pieces.append(b"data: " + out + b"\n\n")
                    seen.append(s)
        if first_seg:
            return (events[skip:] if seen else b""), seen
        return b"".join(pieces), seen


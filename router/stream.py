"""One client's SSE stream, relayed across however many upstream attempts it takes.

The relay forwards whole SSE events only, and remembers the token ids of every event it forwarded
(our engine puts ``token_ids`` on each choice). When the upstream breaks after the client got
tokens, the request is re-issued with ``resume_token_ids`` = exactly those ids and the same
``max_tokens``; the engine generates only the remainder, so the client sees no repeated and no
missing token. Events of a resumed segment get the original ``id``/``created`` so the client sees
one completion. An engine that does not send ``token_ids`` makes the stream non-migratable: it is
retried only before its first byte.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from router.errors import BackendFailed

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode

MIGRATABLE_PATHS = ("/v1/completions", "/v1/chat/completions")


class ClientGone(Exception):
    """The client went away while we wrote to it; nothing to retry, nothing to report."""


class StreamRelay:
    def __init__(self, payload: dict, request: web.Request, adapter=None) -> None:
        self.payload = payload
        self.request = request
        # an engine kind's per-stream migration (router/adapters); None: our engine's resume_token_ids
        self.adapter = adapter.stream(payload, request.path) if adapter is not None else None
        n = payload.get("n", 1)
        self.can_migrate = request.path in MIGRATABLE_PATHS and n in (1, None) and not payload.get("echo")
        if self.adapter is not None and not self.adapter.resumable:
            self.can_migrate, self.why_not = False, self.adapter.why_not
        else:
            self.why_not = "no token_ids"
        self.base_resume = list(payload.get("resume_token_ids") or [])
        self.tokens: list[int] = []  # ids already sent to the client, all segments
        self.segment = 0  # 0: the first upstream attempt; >0: a migrated continuation
        self.first_id: str | None = None
        self.created: int | None = None
        self.finished = False  # a finish_reason was forwarded
        self.done = False  # [DONE] forwarded
        self.response: web.StreamResponse | None = None
        self.first_byte_at: float | None = None  # monotonic, for the latency histogram

    @property
    def started(self) -> bool:
        return self.response is not None

    def resume_body(self) -> bytes:
        """The original request plus the tokens already streamed (same max_tokens: the budget)."""
        return _encode({**self.payload, "resume_token_ids": self.base_resume + self.tokens})

    def upstream(self, target: str, body: bytes | bytearray) -> tuple[str, bytes | bytearray]:
        """The path and body of the next attempt: the first segment's, or a continuation's."""
        if self.adapter is None:
            return target, (self.resume_body() if self.segment > 0 else body)
        if self.segment == 0:
            return target, self.adapter.first_body(self.payload, body)
        resumed = self.adapter.resume_body(self.payload, self.tokens)
        assert resumed is not None, "can_migrate is False without prompt ids (_forward_adapted)"
        return self.adapter.resume_path(), resumed

    async def _start(self, instance: str) -> None:
        """Send the client our 200 and SSE headers: only once a valid first event is in hand."""
        resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Failover-Instance": instance})
        try:
            await resp.prepare(self.request)
        except ConnectionError as exc:
            raise ClientGone() from exc
        self.response = resp
        self.first_byte_at = time.monotonic()

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
        self.segment += 1

    async def forward(self, event: bytes, instance: str) -> bool:
        """Forward one upstream SSE event (without its blank-line terminator); True on [DONE]."""
        data = _data_of(event)
        if data is None:  # comment / keep-alive
            return False
        if data == b"[DONE]":
            if not self.started:
                raise BackendFailed(instance, "garbage", "[DONE] before any event")
            self.done = True
            await self.write(b"data: [DONE]\n\n")
            return True
        if self.adapter is not None:
            return await self._forward_adapted(data, instance)
        try:
            obj = _decode(data)
        except msgspec.DecodeError as exc:
            raise BackendFailed(instance, "garbage", f"undecodable SSE data: {data[:80]!r}") from exc
        if not isinstance(obj, dict):
            raise BackendFailed(instance, "garbage", f"SSE data is not an object: {data[:80]!r}")
        seen = _inspect(obj, instance)
        if self.segment == 0:
            if self.first_id is None:
                self.first_id, self.created = obj.get("id"), obj.get("created")
            out = b"data: " + data + b"\n\n"
        else:
            if not seen.carried and obj.get("usage") is None and "error" not in obj:
                return False  # e.g. the resumed stream's role-only opening chunk
            if self.first_id is not None:
                obj["id"] = self.first_id
            if self.created is not None:
                obj["created"] = self.created
            out = b"data: " + _encode(obj) + b"\n\n"
        if not self.started:
            await self._start(instance)
        await self.write(out)
        # Only now is it the client's: an abort during the write must not count these tokens as sent.
        self.tokens.extend(seen.ids)
        self.finished = self.finished or seen.finished
        self.can_migrate = self.can_migrate and seen.migratable
        return False

    async def _forward_adapted(self, data: bytes, instance: str) -> bool:
        """``forward`` for an engine kind with an adapter (router/adapters)."""
        seen = self.adapter.inspect(data, instance)
        if self.segment == 0:
            if self.first_id is None:
                self.first_id, self.created = self.adapter.head(data, instance)
            out = self.adapter.client_event(data, instance)
        else:
            out = self.adapter.continuation(data, self.first_id, self.created, instance)
            if out is None:
                return False
        if not self.started:
            await self._start(instance)
        await self.write(b"data: " + out + b"\n\n")
        self.tokens.extend(seen.ids)  # only now are they the client's (as in forward)
        self.finished = self.finished or seen.finished
        if self.can_migrate and not seen.migratable:
            self.can_migrate, self.why_not = False, "the engine's events cannot be continued exactly"
        elif self.can_migrate and self.adapter.prompt_ids is None:
            self.can_migrate, self.why_not = False, "the engine sent no prompt_token_ids"
        return False


class _Seen:
    __slots__ = ("ids", "carried", "finished", "migratable")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.carried = self.finished = False
        self.migratable = True


def _inspect(obj: dict, instance: str) -> _Seen:
    """What one chunk carries: token ids, text, a finish_reason; refuses what no engine sends."""
    seen = _Seen()
    choices = obj.get("choices")
    if not isinstance(choices, list):
        if "error" not in obj and obj.get("usage") is None:
            raise BackendFailed(instance, "garbage", "SSE chunk without choices")
        return seen
    for ch in choices:
        if not isinstance(ch, dict):
            raise BackendFailed(instance, "garbage", "SSE choice is not an object")
        if ch.get("index", 0) != 0:
            seen.migratable = False  # n > 1: resuming one choice would not resume the others
        ids = ch.get("token_ids")
        text = ch.get("text")
        if text is None and isinstance(ch.get("delta"), dict):
            text = ch["delta"].get("content")
        if ids:
            seen.ids.extend(ids)
            seen.carried = True
        elif text:
            if ids is None:
                seen.migratable = False  # this engine does not tell us the ids
            seen.carried = True
        if ch.get("finish_reason"):
            seen.finished = seen.carried = True
    return seen


def _data_of(event: bytes) -> bytes | None:
    """The data field of one SSE event (multi-line data joined with newlines), or None."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # the common case, no copy of the split
    parts = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(parts) if parts else None

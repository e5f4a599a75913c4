"""What one engine kind needs for a stream to be migrated: the adapter behind ``Service.resume``.

The relay (router/stream.py) owns the SSE framing, the bytes to the client and the bookkeeping of
what was sent; everything that depends on the engine kind is here, behind ``Resume``:

    first_body(payload, raw)   the body of the first attempt (``raw`` itself when nothing is added)
    inspect(data, instance)    one event's data -> Seen (token ids, text carried, finish_reason)
    head(data)                 the first event's (id, created), stamped on a continuation's events
    resume_path(path)          the path the continuation goes to (ours: the same; vLLM's chat: completions)
    resume_body(payload, sent) the request that continues the stream after the ``sent`` token ids
    continuation(data, ...)    one event of a resumed segment, rewritten for the client (None: drop)
    rewrites_first             True when first-segment events are rewritten for the client too
    client_event(data, ...)    such a first-segment event as the client asked for it

An engine kind (router/adapters) gives one such object per stream (``adapter.stream(payload,
path)``), since it may keep per-stream state (vLLM: the prompt's ids from the first event).

``BundledResume`` is our engine's (``token_ids`` on every choice, ``resume_token_ids`` in the
request). A kind that cannot resume exactly makes ``inspect`` report ``migratable=False``: its
streams are then retried only before their first byte and get an in-band error after it.

Cost contract: ``inspect`` runs once per SSE event on the hot path; it decodes into msgspec Structs
only the fields above (unknown fields are skipped without being built), and never re-encodes.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from router.errors import BackendFailed

_encode = msgspec.json.Encoder().encode
_decode_dict = msgspec.json.Decoder().decode


class Seen:
    """What one SSE event carries, as far as migration needs."""

    __slots__ = ("ids", "carried", "finished", "migratable", "shown")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.carried = self.finished = self.shown = False  # shown: it brought text
        self.migratable = True

    @property
    def clean(self) -> bool:
        """Its ids end where the text so far is whole: one id whose text came with it (a detokenizer
        emits text only when its window ends outside a character), or no id; with several, not known."""
        return not self.ids or (len(self.ids) == 1 and self.shown)

    def choice(self, index: Any, ids: list[int] | None, text: Any, finished: Any) -> None:
        """Account one choice of the event: its ids, whether it carried text, its finish_reason."""
        if index != 0:
            self.migratable = False  # n > 1: resuming one choice would not resume the others
        if text:
            self.shown = True
        if ids:
            self.ids.extend(ids)
            self.carried = True
        elif text:
            if ids is None:
                self.migratable = False  # this engine does not tell us the ids
            self.carried = True
        if finished:
            self.finished = self.carried = True


class Resume(Protocol):
    rewrites_first: bool

    def first_body(self, payload: dict | None, raw: bytes | bytearray) -> bytes | bytearray: ...

    def inspect(self, data: bytes, instance: str) -> Seen: ...

    def head(self, data: bytes) -> tuple[Any, Any]: ...

    def resume_path(self, path: str) -> str: ...

    def resume_body(self, payload: dict, sent: list[int]) -> bytes: ...

    def continuation(self, data: bytes, first_id: Any, created: Any, instance: str) -> bytes | None: ...

    def client_event(self, data: bytes, instance: str) -> bytes: ...


class _Delta(msgspec.Struct):
    content: Any = None


class _Choice(msgspec.Struct):
    index: Any = 0
    text: Any = None
    delta: Any = None  # an object with ``content`` for chat; anything else is no text
    token_ids: list[int] | None = None
    finish_reason: Any = None


class _Event(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: Any = None
    error: Any = msgspec.UNSET


class _Head(msgspec.Struct):
    id: Any = None
    created: Any = None


_decode_event = msgspec.json.Decoder(_Event).decode
_decode_head = msgspec.json.Decoder(_Head).decode


class BundledResume:
    """Our engine: ids on every choice, ``resume_token_ids`` continues after them."""

    rewrites_first = False  # the first segment's bytes go to the client unchanged

    def client_event(self, data: bytes, instance: str) -> bytes:
        return data

    def resume_path(self, path: str) -> str:
        return path

    def first_body(self, payload: dict | None, raw: bytes | bytearray) -> bytes | bytearray:
        return raw  # the engine sends token ids unasked: the client's bytes go through as they are

    def inspect(self, data: bytes, instance: str) -> Seen:
        try:
            ev = _decode_event(data)
        except msgspec.ValidationError as exc:  # JSON, but not an event (a list, choices not objects)
            raise BackendFailed(instance, "garbage", f"SSE data is not an event ({exc}): {data[:80]!r}") from exc
        except msgspec.DecodeError as exc:
            raise BackendFailed(instance, "garbage", f"undecodable SSE data: {data[:80]!r}") from exc
        seen = Seen()
        if ev.choices is None:
            if ev.error is msgspec.UNSET and ev.usage is None:
                raise BackendFailed(instance, "garbage", "SSE chunk without choices")
            return seen
        for ch in ev.choices:
            text = ch.text
            if text is None and isinstance(ch.delta, dict):
                text = ch.delta.get("content")
            seen.choice(ch.index, ch.token_ids, text, ch.finish_reason)
        return seen

    def head(self, data: bytes) -> tuple[Any, Any]:
        try:
            h = _decode_head(data)
        except msgspec.DecodeError:
            return None, None  # inspect() already accepted it; an odd id is not worth a failure
        return h.id, h.created

    def resume_body(self, payload: dict, sent: list[int]) -> bytes:
        base = list(payload.get("resume_token_ids") or [])
        return _encode({**payload, "resume_token_ids": base + sent})

    def continuation(self, data: bytes, first_id: Any, created: Any, instance: str) -> bytes | None:
        obj = _decode_dict(data)  # inspect() passed it: valid JSON object
        if not inspect_dict(obj, instance).carried and obj.get("usage") is None and "error" not in obj:
            return None  # e.g. the resumed stream's role-only opening chunk
        if first_id is not None:
            obj["id"] = first_id
        if created is not None:
            obj["created"] = created
        return _encode(obj)


def inspect_dict(obj: dict, instance: str) -> Seen:
    """``BundledResume.inspect`` for an event already decoded to a dict (a continuation's)."""
    seen = Seen()
    choices = obj.get("choices")
    if not isinstance(choices, list):
        if "error" not in obj and obj.get("usage") is None:
            raise BackendFailed(instance, "garbage", "SSE chunk without choices")
        return seen
    for ch in choices:
        if not isinstance(ch, dict):
            raise BackendFailed(instance, "garbage", "SSE choice is not an object")
        text = ch.get("text")
        if text is None and isinstance(ch.get("delta"), dict):
            text = ch["delta"].get("content")
        seen.choice(ch.get("index", 0), ch.get("token_ids"), text, ch.get("finish_reason"))
    return seen


BUNDLED = BundledResume()

"""What the proxy forwards and how much of it it reads: header drop lists, the request body's head
(``model``, ``stream`` and what decides whether a stream can migrate), the JSON checks of answers.

Shared by the task path (router/proxy.py), the callback-only whole answer (router/answer_now.py)
and the lean listener (router/front.py).
"""

from __future__ import annotations

import msgspec

_decode = msgspec.json.Decoder().decode

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
                        "accept-encoding", "expect"})
# The body is forwarded decoded (router/body.py), so its coding must not be claimed upstream.
REQUEST_DROP = HOP_BY_HOP | {"content-encoding"}
RESPONSE_DROP = HOP_BY_HOP | {"server", "date", "content-encoding"}
# The engine says "not now" (starting, draining, overloaded): try the next primary.
RETRY_STATUS = frozenset({502, 503, 504})
REQUEST_DROP_B = frozenset(k.encode() for k in REQUEST_DROP)
RESPONSE_DROP_B = frozenset(k.encode() for k in RESPONSE_DROP)
MIGRATABLE_PATHS = ("/v1/completions", "/v1/chat/completions")
FORWARD_TAIL = b"Accept-Encoding: identity\r\n"  # we parse streams; the client link may compress later


def error_body(message: str, type_: str, code: int) -> dict:
    return {"error": {"message": message, "type": type_, "code": code}}


class Head(msgspec.Struct):
    """What the proxy reads of every request body; the rest (the prompt too) is skipped unbuilt.
    ``n`` and ``echo`` decide whether a stream can migrate, so a stream of our engine needs no
    second decode (the whole dict is built only if it migrates)."""

    model: object = None
    stream: object = None
    n: object = 1
    echo: object = None


_decode_head = msgspec.json.Decoder(Head).decode


def _looks_like_object(body: bytes | bytearray) -> bool:
    return bool(body) and body[:1] in (b"{", b" ", b"\n", b"\t", b"\r")


def parse_head(body: bytes | bytearray) -> Head | None:
    """The ``Head`` of a JSON object request, or None (malformed: to the engine as is)."""
    if not _looks_like_object(body):
        return None
    try:
        return _decode_head(body)
    except msgspec.DecodeError:  # and ValidationError (not an object)
        return None


def parse(body: bytes | bytearray) -> dict | None:
    """The JSON object of a request, or None (malformed bodies go to the engine unchanged)."""
    if not _looks_like_object(body):
        return None
    try:
        obj = _decode(body)
    except msgspec.DecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def is_json_object(data: bytes) -> bool:
    try:
        return isinstance(_decode(data), dict)
    except msgspec.DecodeError:  # (a Struct that skips every field is 1 us faster, but lets bad UTF-8 by)
        return False


def answer_lines(raw_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The engine's end-to-end response headers as the client's header lines (each ending in CRLF)."""
    return b"".join([b"%b: %b\r\n" % (k, v) for k, v in raw_headers if k.lower() not in RESPONSE_DROP_B])


def forward_headers(headers) -> bytes:
    """The client's end-to-end headers as request header lines for router/upstream.py (each
    ending in CRLF; values as aiohttp's parser accepted them, so with no CR or LF in them).
    router/front.py builds the same lines from the raw head (``FastRequest.forward``)."""
    lines = [f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() not in REQUEST_DROP]
    return "".join(lines).encode("latin-1") + FORWARD_TAIL

"""Request bodies: read within a deadline, under a per-request and a router-wide byte cap, decoded.

A client that declares a large body and then sends it slowly must not pin the router's memory:
every byte a request holds is counted in one ``BodyBudget`` from the moment it is read until the
handler ends (the body is kept for retries and stream migration), the whole body must arrive
within ``body_timeout``, and a gzip/deflate body is inflated in a worker thread with its output
capped, so a bomb stops at ``max_body_bytes``. The router's listener runs with aiohttp's
``auto_decompress=False``: it sees the bytes as sent and the engine gets them decoded, without the
``Content-Encoding`` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from router.config import RouterConfig
from router.errors import BodyRejected

log = structlog.get_logger(__name__)

# Content-Encoding -> zlib wbits. RFC 9110 says to treat x-gzip as gzip.
WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
MAX_GZIP_MEMBERS = 64  # concatenated gzip members are legal; thousands of empty ones are an attack


class BodyBudget:
    """Bytes of request bodies the router holds right now, against ``limit``; one per router."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buffered = 0

    @property
    def left(self) -> int:
        return self.limit - self.buffered

    def full(self) -> BodyRejected:
        return BodyRejected(503, f"the router holds {self.buffered} bytes of request bodies "
                            f"(limit {self.limit}); retry shortly", "service_unavailable")

    def take(self, n: int) -> None:
        if n > self.left:
            raise self.full()
        self.buffered += n

    def give(self, n: int) -> None:
        self.buffered -= n
        assert self.buffered >= 0, f"body budget went negative ({self.buffered})"


class _Held:
    """What one request has taken from the budget; all of it goes back when the request ends."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget, self.n = budget, 0

    def take(self, n: int) -> None:
        self.budget.take(n)
        self.n += n

    def give(self, n: int) -> None:
        self.budget.give(n)
        self.n -= n


@contextlib.asynccontextmanager
async def read_body(request: web.Request, config: RouterConfig,
                    budget: BodyBudget) -> AsyncIterator[bytes | bytearray]:
    """The request's body, decoded; raises BodyRejected (408, 413, 503, 400). Its bytes count
    against ``budget`` until the block ends, and the caller must not keep them past it."""
    coding = _coding(request.headers.getall("Content-Encoding", []))
    held = _Held(budget)
    try:
        raw = await _read_raw(request, config, held)
        if coding is None:
            yield raw
            return
        limit = min(config.max_body_bytes, budget.left)
        body = await asyncio.to_thread(_inflate, raw, coding, limit)
        if body is None:
            if limit < config.max_body_bytes:  # past what is left of the budget, maybe not past the cap
                raise budget.full()
            raise BodyRejected(413, f"request body over {config.max_body_bytes} bytes once decompressed",
                               "request_too_large")
        held.give(len(raw))
        del raw
        held.take(len(body))
        yield body
    finally:
        held.give(held.n)


async def _read_raw(request: web.Request, config: RouterConfig, held: _Held) -> bytes | bytearray:
    declared = request.content_length
    if declared is not None and declared > config.max_body_bytes:
        raise BodyRejected(413, f"request body over {config.max_body_bytes} bytes", "request_too_large")
    if declared is not None and declared > held.budget.left:  # it cannot fit: say so before reading
        raise held.budget.full()
    if request.content.is_eof():  # all of it came with the headers (the usual small body): no timer
        data = request.content.read_nowait()
        if len(data) > config.max_body_bytes:
            raise BodyRejected(413, f"request body over {config.max_body_bytes} bytes", "request_too_large")
        held.take(len(data))
        return data
    buf = bytearray()
    try:
        async with asyncio.timeout(config.body_timeout):
            while chunk := await request.content.readany():
                if len(buf) + len(chunk) > config.max_body_bytes:
                    raise BodyRejected(413, f"request body over {config.max_body_bytes} bytes",
                                       "request_too_large")
                held.take(len(chunk))
                buf += chunk
    except TimeoutError as exc:
        raise BodyRejected(408, f"the request body did not arrive within {config.body_timeout}s "
                           f"({len(buf)} of {declared if declared is not None else '?'} bytes)",
                           "request_timeout") from exc
    return bytes(buf) if len(buf) < 65536 else buf  # small: bytes; large: no second copy


def _coding(values: list[str]) -> str | None:
    """The one content coding to undo (None: identity); BodyRejected(400) for any other."""
    codings = [c.strip().lower() for v in values for c in v.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in WBITS:
        raise BodyRejected(400, f"unsupported Content-Encoding {', '.join(codings)!r}; send the body "
                           "as is, or with gzip or deflate", "invalid_request_error")
    return codings[0]


def _inflate(data: bytes | bytearray, coding: str, limit: int) -> bytearray | None:
    """``data`` decoded, or None if it inflates past ``limit``; BodyRejected(400) if it is not
    valid ``coding``. Runs in a worker thread: never more than ``limit`` + one chunk in memory."""
    out = bytearray()
    view, members = data, 0
    try:
        while True:
            d = zlib.decompressobj(WBITS[coding])
            members += 1
            # max_length caps the output; the input it did not get to waits in unconsumed_tail
            while True:
                out += d.decompress(view, limit + 1 - len(out))
                if len(out) > limit:
                    return None
                if d.eof or not d.unconsumed_tail:
                    break
                view = d.unconsumed_tail
            if not d.eof:
                raise BodyRejected(400, f"the {coding} body is truncated", "invalid_request_error")
            view = d.unused_data
            if not view:
                return out
            if coding == "deflate" or members >= MAX_GZIP_MEMBERS:
                raise BodyRejected(400, f"unexpected data after the {coding} body", "invalid_request_error")
    except zlib.error as exc:
        raise BodyRejected(400, f"the body is not valid {coding}: {exc}", "invalid_request_error") from exc

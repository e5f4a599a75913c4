"""Reading SSE out of an engine's bytes: an event's data field, and the relay's lane.

``data_of`` is the data field of one event (router/stream.py's scan). The rest is the lane (issue
20): the one shape of upstream read that needs no parse to be relayed.

An engine that streams SSE over chunked HTTP writes, token after token, one event per write, each
one HTTP chunk; on loopback each such write is one read of the router's. For that read the
engine's bytes are already what the client must get: the same event in the same chunk framing.
``one_event`` recognises it with a handful of ``bytes`` methods (C, no Python per byte):

    <size in lowercase hex, no leading zero, no extension> CR LF
    "data: " <one line: no CR, no LF> LF LF
    CR LF

and exactly that: one chunk, ending where the read ends, its size equal to its payload's length.
Any other read (a head, several chunks or events, a partial chunk, a comment, CRs in the payload,
uppercase hex, ``[DONE]``) goes the usual way: httptools, then router/stream.py's SSE scan.
A chunk's end leaves httptools where it was, at a chunk's boundary, so reads that skip it and
reads that do not can follow each other in any order (router/upstream.py keeps the boundary).
"""

from __future__ import annotations

_DONE = b"[DONE]"


def one_event(data: bytes) -> bool:
    """``data`` is exactly one HTTP chunk holding exactly one SSE data event of one line."""
    i = data.find(b"\r\n")
    end = len(data) - 4  # where the event's blank line starts, if so
    n = end - i  # the chunk's size, if so: "data: ..." plus its LF LF
    return (0 < i <= 8 and n >= 9 and data.endswith(b"\n\n\r\n") and data.startswith(b"data: ", i + 2)
            and data.find(b"\n", i + 2) == end and data.count(b"\r") == 2 and data[:i] == b"%x" % n
            and data[i + 8:end] != _DONE)


def event_data(data: bytes) -> bytes:
    """The event's data field of a read ``one_event`` accepted."""
    return data[data.find(b"\r\n") + 8:-4]


def data_of(event: bytes) -> bytes | None:
    """The data field of one SSE event (multi-line data joined with newlines), or None."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # the common case, no copy of the split
    parts = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(parts) if parts else None

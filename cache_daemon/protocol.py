"""Every message of the daemon's wire protocol, as one tagged union, and its codec.

A frame is a 4-byte big-endian body length and a msgpack body (``framing.py`` moves frames). Each
body is one of the Structs below, tagged by its ``type`` field. A client starts with :class:`Hello`;
the daemon answers each request with its reply or an :class:`Error`. Arena fds travel with
:class:`FetchReply` (daemon -> client) and :class:`Register` (loader -> daemon) via SCM_RIGHTS.
"""

from __future__ import annotations

from typing import Union

import msgspec

from .errors import ProtocolError
from .fingerprint import CacheConfig
from .manifest import Manifest

PROTOCOL_VERSION = 1
MAX_FRAME = 64 << 20  # a manifest of 10,000 tensors is ~1.5 MiB
MAX_FDS = 253  # SCM_MAX_FD


class _Msg(msgspec.Struct, frozen=True, tag_field="type"):
    pass


# client -> daemon
class Hello(_Msg, tag="hello"):
    version: int
    client: str = ""


class Query(_Msg, tag="query"):
    config: CacheConfig


class Fetch(_Msg, tag="fetch"):
    config: CacheConfig


class Status(_Msg, tag="status"):
    pass


class Ping(_Msg, tag="ping"):
    nonce: int = 0


class Evict(_Msg, tag="evict"):
    config: CacheConfig
    # False: refused (in_use) while engines map the model, since a running node relaunches from it
    force: bool = False


# daemon -> client
class Welcome(_Msg, tag="welcome"):
    version: int
    pid: int


class QueryReply(_Msg, tag="query_reply"):
    nbytes: int
    attached: int


class FetchReply(_Msg, tag="fetch_reply"):
    manifest: Manifest
    nfds: int


class ModelStatus(msgspec.Struct, frozen=True):
    key: str
    model_path: str
    tp_rank: int
    tp_size: int
    device: str
    dtype: str
    transform: str
    nbytes: int
    attached: int


class StatusReply(_Msg, tag="status_reply"):
    pid: int
    version: int
    loading: bool
    models: list[ModelStatus]
    clients: int  # connections open now
    attached: int  # of those, how many hold a mapping (fetched and still connected)
    buffered: int = 0  # bytes reserved by frames being received now (capped by --max-buffered-mib)
    load: LoadState | None = None  # the load's progress (its last state once loaded)


class LoadState(msgspec.Struct, frozen=True):
    done: int  # bytes packed so far, every rank of the load together
    total: int
    seconds: float  # since the load started


class Pong(_Msg, tag="pong"):
    nonce: int


class Evicted(_Msg, tag="evicted"):
    nbytes: int


class Error(_Msg, tag="error"):
    code: str  # see ERROR_CODES
    message: str
    diff: list[str] = []


# loader -> daemon (over the loader's private socketpair, never the public socket)
class Register(_Msg, tag="register"):
    config: CacheConfig
    manifest: Manifest
    nfds: int


class Registered(_Msg, tag="registered"):
    pass


class LoadProgress(_Msg, tag="load_progress"):
    done: int  # bytes packed so far, every rank of this load together (no reply)
    total: int


class LoadFailed(_Msg, tag="load_failed"):
    code: str
    message: str


Message = Union[Hello, Query, Fetch, Status, Ping, Evict, Welcome, QueryReply, FetchReply, StatusReply,
                Pong, Evicted, Error, Register, Registered, LoadProgress, LoadFailed]
TAGS = {cls.__struct_config__.tag for cls in Message.__args__}
ERROR_CODES = ("bad_frame", "too_large", "malformed", "unknown_type", "unexpected", "bad_version",
               "timeout", "busy", "forbidden", "not_resident", "mismatch", "in_use", "internal")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(body: bytes) -> Message:
    """Decode one frame body; a :class:`ProtocolError` says which way it is wrong."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as e:
        problem = e
    except (msgspec.DecodeError, ValueError) as e:  # msgspec lets a UnicodeDecodeError through
        raise ProtocolError(f"frame body is not msgpack: {e}", "malformed") from None
    try:
        raw = msgspec.msgpack.decode(body)
    except (msgspec.DecodeError, ValueError):
        raw = None
    if isinstance(raw, dict) and raw.get("type") not in TAGS:
        raise ProtocolError(f"unknown message type {str(raw.get('type'))[:40]!r}", "unknown_type")
    raise ProtocolError(f"invalid message: {problem}", "malformed")

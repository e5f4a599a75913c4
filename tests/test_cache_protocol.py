"""Framing and codec of the daemon's wire protocol: property tests over sockets, fds, errors."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_daemon import framing, protocol
from cache_daemon.errors import ProtocolError
from cache_daemon.protocol import Error, Hello, ModelStatus, Ping, Status, StatusReply

small_text = st.text(max_size=200)
messages = st.one_of(
    st.builds(Hello, version=st.integers(0, 2**31), client=small_text),
    st.builds(Ping, nonce=st.integers(-2**63, 2**63 - 1)),
    st.builds(Status),
    st.builds(Error, code=st.sampled_from(protocol.ERROR_CODES), message=small_text,
              diff=st.lists(small_text, max_size=5)),
    st.builds(StatusReply, pid=st.integers(1, 2**22), version=st.integers(0, 9), loading=st.booleans(),
              models=st.lists(st.builds(ModelStatus, key=small_text, model_path=small_text,
                                        tp_rank=st.integers(0, 7), tp_size=st.integers(1, 8),
                                        device=st.sampled_from(["cpu", "cuda"]), dtype=small_text,
                                        transform=small_text, nbytes=st.integers(0, 2**50),
                                        attached=st.integers(0, 100)), max_size=4),
              clients=st.integers(0, 1000), attached=st.integers(0, 1000)),
)


def _feed(sock: socket.socket, data: bytes, cuts: list[int], close: bool = True) -> threading.Thread:
    """Write ``data`` in pieces cut at ``cuts`` from a thread, then (optionally) close."""
    def run():
        at = 0
        for cut in sorted(set(c % (len(data) + 1) for c in cuts)) + [len(data)]:
            if cut > at:
                sock.sendall(data[at:cut])
                at = cut
        if close:
            sock.shutdown(socket.SHUT_WR)
    t = threading.Thread(target=run)
    t.start()
    return t


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=st.lists(messages, min_size=1, max_size=5), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_frames_round_trip_however_the_stream_is_cut(msgs, cuts):
    a, b = socket.socketpair()
    with a, b:
        writer = _feed(a, b"".join(framing.encode_frame(m) for m in msgs), cuts)
        got = [framing.recv_frame(b)[0] for _ in msgs]
        writer.join()
        with pytest.raises(ProtocolError) as e:
            framing.recv_frame(b)
        assert e.value.code == "closed"
    assert got == msgs


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=300))
def test_garbage_never_raises_anything_but_protocol_error(data):
    a, b = socket.socketpair()
    with a, b:
        writer = _feed(a, data, [])
        try:
            while True:
                framing.recv_frame(b, max_size=1 << 16)
        except ProtocolError as e:
            assert e.code in ("closed", "bad_frame", "too_large", "malformed", "unknown_type")
        writer.join()


@settings(max_examples=100, deadline=None)
@given(body=st.binary(min_size=1, max_size=200))
def test_any_body_decodes_or_is_a_protocol_error(body):
    try:
        msg = protocol.decode(body)
    except ProtocolError as e:
        assert e.code in ("malformed", "unknown_type")
    else:
        assert type(msg) in protocol.Message.__args__


def test_specific_codes_for_specific_faults():
    with pytest.raises(ProtocolError) as e:
        protocol.decode(msgspec.msgpack.encode({"type": "launch", "x": 1}))
    assert e.value.code == "unknown_type" and "launch" in str(e.value)
    with pytest.raises(ProtocolError) as e:
        protocol.decode(msgspec.msgpack.encode({"type": "hello", "version": "one"}))
    assert e.value.code == "malformed"
    with pytest.raises(ProtocolError) as e:
        protocol.decode(b"\xc1")
    assert e.value.code == "malformed"
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", protocol.MAX_FRAME + 1))
        with pytest.raises(ProtocolError) as e:
            framing.recv_frame(b)
        assert e.value.code == "too_large"
        a.sendall(struct.pack(">I", 0))
        with pytest.raises(ProtocolError) as e:
            framing.recv_frame(b)
        assert e.value.code == "bad_frame"
        a.sendall(struct.pack(">I", 50) + b"x" * 10)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError) as e:
            framing.recv_frame(b)
        assert e.value.code == "bad_frame" and "10 of 50" in str(e.value)


def test_oversized_message_is_refused_before_sending():
    with pytest.raises(ProtocolError) as e:
        framing.encode_frame(Error("internal", "x" * (protocol.MAX_FRAME + 1)))
    assert e.value.code == "too_large"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_fds_travel_with_a_frame_and_unexpected_fds_are_dropped():
    r, w = os.pipe()
    a, b = socket.socketpair()
    with a, b:
        framing.send_frame(a, Ping(7), [r, w])
        msg, fds = framing.recv_frame(b, max_fds=4)
        assert msg == Ping(7) and len(fds) == 2
        os.write(fds[1], b"hi")
        assert os.read(r, 2) == b"hi"
        framing.close_fds(fds)
        before = _open_fds()
        framing.send_frame(a, Ping(8), [r, w])
        assert framing.recv_frame(b) == (Ping(8), [])  # not expecting fds: the kernel closes them
        assert _open_fds() == before
    os.close(r)
    os.close(w)


def test_async_helpers_round_trip_with_fds():
    async def run():
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        r, w = os.pipe()
        try:
            big = Error("internal", "y" * 3_000_000)  # larger than the socket buffer
            send = asyncio.create_task(framing.async_send_frame(a, big, [r]))
            msg, fds = await framing.async_recv_frame(b, max_fds=1)
            await send
            assert msg == big and len(fds) == 1
            framing.close_fds(fds)
        finally:
            for fd in (r, w):
                os.close(fd)
            a.close()
            b.close()
    asyncio.run(run())

"""Bad clients against a live daemon: each gets a specific error, and everyone else is still served."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading
import time
import warnings
from pathlib import Path

import msgspec
import pytest

from cache_daemon import framing
from cache_daemon.client import Connection, attach, ping, status
from cache_daemon.errors import AccessDenied
from cache_daemon.fingerprint import make_config
from cache_daemon.peers import peer_allowed
from cache_daemon.protocol import (MAX_FRAME, PROTOCOL_VERSION, Error, Fetch, FetchReply, Hello, Ping, Pong,
                                   Welcome)
from conftest import Procs
from cache_daemon_helpers import raw_connect, start_daemon, stop_daemon
from supervisor_helpers import wait_until

NOBODY = 65534
FRAME_TIMEOUT = 1.0  # --frame-timeout of the module's daemon
MIB = 1 << 20


@pytest.fixture(scope="module")
def daemon(tiny_model):
    run_dir = Path(tempfile.mkdtemp(prefix="fo-", dir="/tmp"))
    procs = Procs()
    proc = start_daemon(procs, tiny_model, run_dir, "--client-timeout", "1", "--frame-timeout", str(FRAME_TIMEOUT),
                        "--max-buffered-mib", "64")
    yield {"proc": proc, "sock": run_dir / "daemon.sock", "model": tiny_model}
    rc, err = stop_daemon(proc)
    procs.stop_all()
    shutil.rmtree(run_dir, ignore_errors=True)
    assert rc == 0, err


def _error_then_closed(s: socket.socket) -> Error:
    reply, _ = framing.recv_frame(s)
    assert isinstance(reply, Error)
    assert s.recv(1) == b""  # and the daemon closed the connection
    return reply


def _still_serving(daemon) -> None:
    assert ping(daemon["sock"])
    assert daemon["proc"].poll() is None


def test_oversized_frame(daemon):
    with raw_connect(daemon["sock"]) as s:
        s.sendall(struct.pack(">I", MAX_FRAME + 1))
        assert _error_then_closed(s).code == "too_large"
    _still_serving(daemon)


def test_truncated_frame(daemon):
    with raw_connect(daemon["sock"]) as s:
        s.sendall(struct.pack(">I", 100) + b"\x81" * 10)
        s.shutdown(socket.SHUT_WR)
        err = _error_then_closed(s)
        assert err.code == "bad_frame" and "10 of 100" in err.message
    _still_serving(daemon)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _attached(daemon) -> socket.socket:
    """A raw connection that has fetched (so the daemon no longer bounds its idle time)."""
    s = raw_connect(daemon["sock"])
    framing.send_frame(s, Fetch(make_config(daemon["model"], dtype="float32", tp_size=1, tp_rank=0)))
    reply, fds = framing.recv_frame(s, max_fds=8)
    framing.close_fds(fds)
    assert isinstance(reply, FetchReply)
    return s


def test_a_frame_stalled_after_attach_is_closed_at_the_deadline_and_its_memory_given_back(daemon):
    pid = daemon["proc"].pid
    before = _rss(pid)
    with _attached(daemon) as s:
        s.sendall(struct.pack(">I", 60 * MIB) + b"\x00" * (40 * MIB))  # 40 of 60 MiB, then silence
        t0 = time.monotonic()
        held = status(daemon["sock"])
        assert held.buffered == 60 * MIB and held.attached >= 1
        assert _rss(pid) - before > 30 * MIB, "the partial frame is really buffered"
        err = _error_then_closed(s)
        waited = time.monotonic() - t0
    assert err.code == "timeout" and "frame not complete" in err.message
    assert waited >= FRAME_TIMEOUT * 0.5, "closed at the frame deadline, not at once"
    assert status(daemon["sock"]).buffered == 0
    assert _rss(pid) - before < 16 * MIB, "the partial frame's memory went back to the system"
    _still_serving(daemon)


def test_frames_past_the_total_buffer_cap_close_their_connection_while_others_are_served(daemon):
    with raw_connect(daemon["sock"]) as a, raw_connect(daemon["sock"]) as b, raw_connect(daemon["sock"]) as c:
        a.sendall(struct.pack(">I", 30 * MIB) + b"\x00" * 100)
        b.sendall(struct.pack(">I", 30 * MIB) + b"\x00" * 100)
        wait_until(lambda: status(daemon["sock"]).buffered == 60 * MIB, 5, "two frames reserved")
        c.sendall(struct.pack(">I", 30 * MIB))  # 90 MiB would pass the 64 MiB cap
        err = _error_then_closed(c)
        assert err.code == "busy" and "cap" in err.message
        assert ping(daemon["sock"])  # a small frame still fits
        a.close()
        b.close()
        wait_until(lambda: status(daemon["sock"]).buffered == 0, 5, "the reservations given back")
    _still_serving(daemon)


def test_garbage_and_unknown_types_get_errors_on_a_connection_that_goes_on(daemon):
    with raw_connect(daemon["sock"]) as s:
        s.sendall(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
        assert framing.recv_frame(s)[0].code == "malformed"
        body = msgspec.msgpack.encode({"type": "format_disk", "now": True})
        s.sendall(struct.pack(">I", len(body)) + body)
        err = framing.recv_frame(s)[0]
        assert err.code == "unknown_type" and "format_disk" in err.message
        framing.send_frame(s, Ping(3))
        assert framing.recv_frame(s)[0] == Pong(3)


def test_loader_only_messages_are_refused_from_clients(daemon):
    conn = Connection(daemon["sock"])
    try:
        framing.send_frame(conn.sock, Welcome(1, 1))
        err = framing.recv_frame(conn.sock)[0]
        assert err.code == "unexpected" and "Welcome" in err.message
    finally:
        conn.close()


def test_wrong_protocol_version(daemon):
    with raw_connect(daemon["sock"], hello=False) as s:
        framing.send_frame(s, Hello(PROTOCOL_VERSION + 41, "from the future"))
        err = _error_then_closed(s)
        assert err.code == "bad_version" and str(PROTOCOL_VERSION + 41) in err.message


def test_first_message_must_be_hello(daemon):
    with raw_connect(daemon["sock"], hello=False) as s:
        framing.send_frame(s, Ping(1))
        assert _error_then_closed(s).code == "unexpected"


def test_silent_client_times_out_while_others_are_served(daemon):
    with raw_connect(daemon["sock"], hello=False) as silent:
        for _ in range(3):
            _still_serving(daemon)  # answered at once although one client holds a connection
        assert _error_then_closed(silent).code == "timeout"


def test_many_clients_at_once(daemon):
    config = make_config(daemon["model"], dtype="float32", tp_size=1, tp_rank=0)
    failures = []

    def one():
        try:
            with attach(daemon["sock"], config) as w:
                assert len(w.tensors) > 10
            assert status(daemon["sock"]).models
        except Exception as e:  # collected and asserted below
            failures.append(e)
    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_uid_policy():
    assert peer_allowed(1000, daemon_uid=1000)
    assert not peer_allowed(1001, daemon_uid=1000)
    assert peer_allowed(1001, daemon_uid=1000, allow_uids=frozenset({1001}))
    assert not peer_allowed(0, daemon_uid=1000), "root is not let in unless listed"


def _as_nobody(sock_path: Path) -> str:
    """Connect from a forked child running as uid nobody; return what it saw."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process (3.12+)
        pid = os.fork()
    if pid == 0:
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect(str(sock_path))
                try:  # a refused peer is told at once and closed: the hello may meet a closed socket
                    framing.send_frame(s, Hello(PROTOCOL_VERSION))
                except (BrokenPipeError, ConnectionResetError):
                    pass
                result = repr(framing.recv_frame(s)[0])
            except PermissionError:
                result = "PermissionError"
            except Exception as e:  # reported to the parent, which fails the test with it
                result = f"unexpected {e!r}"
            os.write(w, result.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another uid")
def test_other_uid_is_refused_by_permissions_and_by_peer_credentials(daemon):
    sock = daemon["sock"]
    assert _as_nobody(sock) == "PermissionError"  # 0700 run dir, 0600 socket
    os.chmod(sock.parent, 0o755)
    os.chmod(sock, 0o777)
    try:
        out = _as_nobody(sock)  # through the file system now; SO_PEERCRED still says no
    finally:
        os.chmod(sock, 0o600)
        os.chmod(sock.parent, 0o700)
    assert "Error(code='forbidden'" in out and str(NOBODY) in out
    _still_serving(daemon)


def test_client_maps_forbidden_to_access_denied(daemon, run_dir):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = run_dir / "fake.sock"
    listener.bind(str(path))
    listener.listen(1)

    def fake_daemon():
        c, _ = listener.accept()
        with c:
            framing.recv_frame(c)
            framing.send_frame(c, Error("forbidden", "uid 1 may not use this daemon"))
    t = threading.Thread(target=fake_daemon)
    t.start()
    try:
        with pytest.raises(AccessDenied):
            Connection(path)
    finally:
        t.join()
        listener.close()

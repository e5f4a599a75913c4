"""The one copy of each shared mechanism: frame codec, size grammar, free ports, parent-death signal,
backoff and restart policy, dtype "auto" and the tp rule."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest
import tenacity

from cache_daemon.layout import resolve_dtype, undivided_by_tp
from failover_common import frames
from failover_common.ports import HIGH, LOW, free_ports, port_is_free
from failover_common.proc import pid_alive, running
from failover_common.sizes import parse_size


# -- frames --------------------------------------------------------------------------------------

def test_frames_round_trip_and_name_what_went_wrong():
    a, b = socket.socketpair()
    with a, b:
        frames.send(a, frames.pack(b"hello", 64))
        assert frames.recv(b, max_size=64) == (b"hello", [])
        with pytest.raises(frames.FrameError) as e:
            frames.pack(b"x" * 65, 64)
        assert e.value.code == "too_large"
        a.sendall(frames.HEADER.pack(65))
        with pytest.raises(frames.FrameError) as e:
            frames.recv(b, max_size=64)
        assert e.value.code == "too_large"
        a.sendall(frames.HEADER.pack(10) + b"abc")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(frames.FrameError) as e:
            frames.recv(b, max_size=64)
        assert e.value.code == "bad_frame"
        with pytest.raises(frames.FrameError) as e:
            frames.recv(b, max_size=64)
        assert e.value.code == "closed"


def test_stream_reader_refuses_an_oversized_frame_before_reading_its_body():
    async def scenario() -> str:
        reader = asyncio.StreamReader()
        reader.feed_data(frames.HEADER.pack(1 << 30))  # announces 1 GiB, sends nothing more
        try:
            await asyncio.wait_for(frames.read_stream(reader, max_size=1 << 20), 5)
        except frames.FrameError as e:
            return e.code
        return "read"

    assert asyncio.run(scenario()) == "too_large"


# -- sizes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [("1GB", 10**9), ("1GiB", 2**30), ("256MiB", 256 << 20),
                                         ("64KiB", 65536), ("1.5GB", 1_500_000_000), ("4096", 4096),
                                         ("12 b", 12), ("2kb", 2000)])
def test_one_size_grammar(text, value):
    assert parse_size(text) == value


def test_a_bare_unit_is_refused_in_the_config_and_on_the_engine_cli():
    with pytest.raises(ValueError, match="ambiguous; write 1GiB .* or 1GB"):
        parse_size("1G")
    from engine.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--port", "1", "--kv-memory", "256M"])
    args = build_parser().parse_args(["--model", "m", "--port", "1", "--kv-memory", "1GB"])
    assert args.kv_memory == 10**9  # the same meaning as kv_memory = "1GB" in the node config


# -- ports ---------------------------------------------------------------------------------------

def test_port_is_free_sees_a_listener_and_free_ports_stay_below_the_ephemeral_range():
    first = free_ports(2)
    assert LOW <= first and first + 1 < HIGH
    assert port_is_free(first) and port_is_free(first + 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", first))
        s.listen()
        assert not port_is_free(first)
    assert port_is_free(first)


# -- PR_SET_PDEATHSIG ----------------------------------------------------------------------------

PARENT = """
import functools, signal, subprocess, sys, time
from failover_common.proc import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         preexec_fn=functools.partial(die_with_parent, signal.SIGKILL))
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_child_armed_with_die_with_parent_goes_with_its_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not running(child)
    finally:
        parent.kill()
        parent.stdout.close()
        parent.wait(10)


def test_running_is_false_for_a_zombie_and_for_a_reaped_process():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert running(child.pid) and pid_alive(child.pid)
        child.stdin.close()  # it exits; unreaped, it is a zombie
        deadline = time.monotonic() + 10
        while running(child.pid):
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.02)
        assert pid_alive(child.pid), "reaped already: the zombie case was not reached"
    finally:
        child.kill()
        child.wait(10)
    assert not running(child.pid) and not pid_alive(child.pid)


# -- backoff and the restart policy --------------------------------------------------------------

def test_backoff_doubles_to_its_cap_and_jitter_stays_in_bounds():
    from failover.procs.restart import Backoff

    b = Backoff(0.5, 3.0)
    assert [b.delay(n) for n in range(6)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]
    j = Backoff(1.0, 8.0, jitter=0.2)
    assert all(0.8 * 4.0 <= j.delay(3) <= 1.2 * 4.0 for _ in range(200))


def test_backoff_is_tenacitys_wait_on_the_real_retry_state():
    from failover.procs.restart import Backoff

    waits: list[float] = []

    async def scenario() -> int:
        calls = 0
        retrying = tenacity.AsyncRetrying(stop=tenacity.stop_after_attempt(4), wait=Backoff(0.01, 0.02),
                                          before_sleep=lambda s: waits.append(s.next_action.sleep), reraise=True)
        async for attempt in retrying:
            with attempt:
                calls += 1
                if calls < 4:
                    raise OSError("not yet")
        return calls

    assert asyncio.run(scenario()) == 4
    assert waits == [0.01, 0.02, 0.02]


def test_restart_policy_counts_failures_only_and_gives_up_on_a_crash_loop():
    from failover.config.schema import SupervisorConfig
    from failover.procs.restart import CrashLoop, RestartPolicy

    policy = RestartPolicy(SupervisorConfig(backoff_initial=0.1, backoff_max=1.0, crash_loop_exits=3,
                                            crash_loop_window=60.0), jitter=0.0)
    assert policy.next_delay("chat", failure=False, now=0.0) == 0.0  # a planned recycle: not counted
    assert policy.next_delay("chat", failure=True, now=1.0) == 0.0  # the first failure: at once
    assert policy.next_delay("chat", failure=True, now=2.0) == 0.1
    with pytest.raises(CrashLoop, match="exited 3 times"):
        policy.next_delay("chat", failure=True, now=3.0)
    policy.forget("chat")
    assert policy.next_delay("chat", failure=True, now=4.0) == 0.0


def test_restart_policy_jitters_its_delays_and_gives_up_on_failed_starts_in_a_row():
    from failover.config.schema import SupervisorConfig
    from failover.procs.restart import CrashLoop, RestartPolicy

    cfg = SupervisorConfig(backoff_initial=1.0, backoff_max=8.0, crash_loop_exits=100, crash_loop_window=60.0,
                           restart_attempts=3)
    delays = set()
    for _ in range(50):
        policy = RestartPolicy(cfg)  # the default jitter, 20 %
        policy.record_exit("chat", now=0.0)
        delays.add(policy.record_exit("chat", now=1.0, why="chat-0 failed to start: boom", failed_starts=1))
    assert all(0.8 <= d <= 1.2 for d in delays) and len(delays) > 1
    policy = RestartPolicy(cfg)
    policy.record_exit("chat", now=0.0, failed_starts=2)
    with pytest.raises(CrashLoop, match="3 replacements in a row failed to start; the last: chat-0 failed"):
        policy.record_exit("chat", now=1.0, why="chat-0 failed to start: boom", failed_starts=3)


# -- dtype "auto" and the tp rule ----------------------------------------------------------------

def test_dtype_auto_resolves_the_same_for_the_engine_and_the_daemon(tmp_path):
    from engine.cli import resolve_dtype as engine_resolve

    for torch_dtype, want in (("bfloat16", "bfloat16"), ("float64", "float32"), (None, "float32")):
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": torch_dtype}))
        assert engine_resolve(tmp_path, "auto") == resolve_dtype("auto", {"torch_dtype": torch_dtype}) == want
    assert resolve_dtype("float16", {"torch_dtype": "bfloat16"}) == "float16"


def test_tp_must_divide_heads_kv_heads_and_intermediate_size():
    cfg = {"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 96}
    assert undivided_by_tp(cfg, 2) == []
    assert undivided_by_tp(cfg, 4) == [("num_key_value_heads", 2)]
    assert undivided_by_tp({"num_attention_heads": 6, "intermediate_size": 10}, 4) == [
        ("num_attention_heads", 6), ("num_key_value_heads", 6), ("intermediate_size", 10)]


"""Unit tests of the router's pieces that need no process: roles, config, token file, SSE relay."""

from __future__ import annotations

import asyncio
import os

import pytest
import structlog

from router import states
from router.admin import TokenFileError, read_token
from router.backend import Attempt, Instance
from router.config import RouterConfig
from router.sse import data_of
from router.stream import _inspect


def make(role: str = states.PRIMARY) -> Instance:
    return Instance("svc", "svc-0", "http://127.0.0.1:1", role, pid=None)


@pytest.mark.parametrize("old", states.ROLES)
@pytest.mark.parametrize("new", states.ROLES)
def test_transition_table_is_enforced(old, new):
    inst = make(states.PRIMARY)
    inst.role = old  # put it there directly: the table is what is under test
    if new in states.ALLOWED[old]:
        states.change_role(inst, new, "test")
        assert inst.role == new and inst.last_transition.old == old
    else:
        with pytest.raises(states.IllegalTransition, match=f"{old} -> {new}"):
            states.change_role(inst, new, "test")
        assert inst.role == old  # refused changes leave no trace


def test_every_role_can_leave_and_none_stays_stuck():
    assert set(states.ALLOWED) == set(states.ROLES)
    for role, targets in states.ALLOWED.items():
        assert targets and role not in targets and targets <= set(states.ROLES)


def test_change_role_emits_exactly_one_event_with_timings():
    inst = make(states.STANDBY)
    with structlog.testing.capture_logs() as logs:
        states.change_role(inst, states.PRIMARY, "promoted: exited", switch_ms=0.1234)
    assert logs == [{"event": "role_changed", "log_level": "info", "service": "svc", "instance": "svc-0",
                     "old": "standby", "new": "primary", "reason": "promoted: exited", "switch_ms": 0.123}]
    assert inst.last_transition.as_json()["to"] == "primary"


def test_instances_start_only_as_primary_or_standby():
    with pytest.raises(ValueError, match="starts as primary or standby"):
        states.initial(states.DRAINING)


@pytest.mark.parametrize("field,value", [("probe_interval", 0), ("probe_timeout", -1), ("port", 70000),
                                         ("failure_threshold", 0), ("queue_size", -1), ("max_body_bytes", 10),
                                         ("probe_path", "ready")])
def test_config_refuses_nonsense(field, value):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})


def test_config_defaults_are_loopback_and_fast():
    c = RouterConfig()
    assert c.host == "127.0.0.1" and c.probe_interval == 0.1 and c.probe_timeout == 0.25
    assert c.retry_after_s >= 1


def test_token_file_must_be_private(tmp_path):
    path = tmp_path / "token"
    with pytest.raises(TokenFileError, match="does not exist"):
        read_token(path)
    path.write_text("s3cret\n")
    os.chmod(path, 0o644)
    with pytest.raises(TokenFileError, match="chmod 600"):
        read_token(path)
    os.chmod(path, 0o600)
    assert read_token(path) == b"s3cret"
    path.write_text("\n")
    with pytest.raises(TokenFileError, match="empty"):
        read_token(path)


def test_sse_parsing_and_chunk_inspection():
    assert data_of(b"data: {}") == b"{}"
    assert data_of(b": keep-alive") is None
    assert data_of(b"event: x\ndata: a\ndata: b") == b"a\nb"
    seen = _inspect({"choices": [{"index": 0, "text": "hi", "token_ids": [5, 6], "finish_reason": None}]}, "e")
    assert seen.ids == [5, 6] and seen.carried and seen.migratable and not seen.finished
    seen = _inspect({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]}, "e")
    assert not seen.migratable and seen.finished  # text without ids: cannot be resumed exactly
    seen = _inspect({"choices": [{"index": 1, "text": "", "token_ids": []}]}, "e")
    assert not seen.migratable  # n > 1
    assert not _inspect({"choices": [], "usage": {"completion_tokens": 3}}, "e").carried


@pytest.mark.asyncio
async def test_fencing_aborts_an_armed_attempt_and_waits_for_a_disarmed_one():
    inst = make()
    armed, writing = Attempt(), Attempt()
    inst.attempts |= {armed, writing}

    async def upstream_read(attempt: Attempt) -> str:
        try:
            async with attempt.guard:
                await asyncio.sleep(10)  # a read from a hung engine
        except TimeoutError:
            return "aborted"
        return "finished"

    async def client_write(attempt: Attempt) -> bool:
        async with attempt.guard:
            attempt.disarm()
            await asyncio.sleep(0.05)  # a slow client: this write must not be cut in half
            return attempt.rearm()

    tasks = [asyncio.create_task(upstream_read(armed)), asyncio.create_task(client_write(writing))]
    await asyncio.sleep(0.01)
    assert inst.abort_inflight() == 2
    assert await tasks[0] == "aborted"
    assert await tasks[1] is False  # the write completed; the abort is seen right after it

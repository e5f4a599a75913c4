"""failover_common/tasks.py: background tasks held until they end, stopped together."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest


from failover_common.tasks import Tasks


@pytest.mark.asyncio
async def test_a_spawned_task_is_held_while_it_runs_and_dropped_once_it_ends():
    tasks, gate = Tasks(), asyncio.Event()

    async def work() -> str:
        await gate.wait()
        return "done"

    task = tasks.spawn(work(), "work-1")
    del task
    gc.collect()  # the loop's own reference is weak: only the set keeps the task alive
    assert [t.get_name() for t in tasks] == ["work-1"]
    gate.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(tasks) == 0


@pytest.mark.asyncio
async def test_stop_cancels_what_runs_and_swallows_what_failed(caplog):
    tasks, cancelled = Tasks(), []

    async def forever(k: int) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(k)
            raise

    async def fails() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("boom as it was cancelled") from None

    for k in range(3):
        tasks.spawn(forever(k), f"forever-{k}")
    tasks.spawn(fails(), "fails")
    await asyncio.sleep(0)  # each one started
    await tasks.stop()
    assert sorted(cancelled) == [0, 1, 2] and len(tasks) == 0
    gc.collect()  # a failed task whose exception nobody took is reported as it is collected
    assert "never retrieved" not in caplog.text


@pytest.mark.asyncio
async def test_grace_lets_a_task_finish_and_cancels_only_the_rest():
    tasks, finished, cancelled = Tasks(), [], []

    async def short() -> None:
        await asyncio.sleep(0.05)
        finished.append("short")

    async def long() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append("long")
            raise

    tasks.spawn(short(), "short")
    tasks.spawn(long(), "long")
    t0 = time.monotonic()
    await tasks.stop(grace=0.5)
    assert finished == ["short"] and cancelled == ["long"]
    assert time.monotonic() - t0 >= 0.5  # the long one had its grace before it was cancelled


@pytest.mark.asyncio
async def test_a_task_that_refuses_its_cancellation_holds_stop_only_for_the_timeout():
    tasks, release = Tasks(), asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await release.wait()

    task = tasks.spawn(stubborn(), "stubborn")
    await asyncio.sleep(0)
    t0 = time.monotonic()
    await tasks.stop(timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2.0 and not task.done()
    release.set()
    await asyncio.wait_for(task, 2.0)


def test_spawn_needs_a_running_loop():
    async def nothing() -> None:
        pass

    coro = nothing()
    with pytest.raises(RuntimeError):
        Tasks().spawn(coro, "x")
    coro.close()

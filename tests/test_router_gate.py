"""router.backend.Gate: the per-instance cap on upstream requests and its bounded, ordered queue."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.backend import Gate
from router.errors import Saturated

pytestmark = pytest.mark.asyncio


def later(seconds: float) -> float:
    return time.monotonic() + seconds


async def test_cap_then_queue_in_order_then_refusal():
    gate = Gate(limit=2, queue_size=2)
    await gate.enter("i", later(1))
    await gate.enter("i", later(1))
    order = []

    async def waiter(n: int) -> None:
        await gate.enter("i", later(5))
        order.append(n)

    tasks = [asyncio.create_task(waiter(n)) for n in (1, 2)]
    await asyncio.sleep(0.01)
    assert (gate.active, gate.waiting) == (2, 2)
    with pytest.raises(Saturated, match="queue is full"):
        await gate.enter("i", later(1))
    gate.leave()
    gate.leave()
    await asyncio.gather(*tasks)
    assert order == [1, 2] and gate.active == 2  # each slot passed straight on
    gate.leave()
    gate.leave()
    assert gate.active == 0


async def test_a_waiter_past_its_deadline_is_refused_and_leaves_the_queue():
    gate = Gate(limit=1, queue_size=4)
    await gate.enter("i", later(1))
    with pytest.raises(Saturated, match="queue deadline"):
        await gate.enter("i", later(0.05))
    assert gate.waiting == 0
    gate.leave()
    assert gate.active == 0


async def test_a_cancelled_waiter_does_not_keep_a_slot():
    gate = Gate(limit=1, queue_size=4)
    await gate.enter("i", later(1))
    t = asyncio.create_task(gate.enter("i", later(5)))
    await asyncio.sleep(0.01)
    gate.leave()  # hands the slot to t ...
    t.cancel()  # ... which is cancelled before it runs: the slot must come back
    with pytest.raises(asyncio.CancelledError):
        await t
    assert gate.active == 0 and gate.waiting == 0


async def test_release_all_lets_every_waiter_through():
    gate = Gate(limit=1, queue_size=8)
    await gate.enter("i", later(1))
    tasks = [asyncio.create_task(gate.enter("i", later(5))) for _ in range(3)]
    await asyncio.sleep(0.01)
    gate.release_all()
    await asyncio.gather(*tasks)
    assert gate.active == 4 and gate.waiting == 0
    for _ in range(4):
        gate.leave()
    assert gate.active == 0

"""KV pools that follow the roles: a standby holds a small pool, a primary the full one.

The router decides roles; this module listens (``Router.watch_roles``) and resizes the engines'
pools through their ``POST /admin/kv`` (with the engine token the supervisor holds):

- an instance becomes **primary** (a failover or a planned switchover): it serves at once with
  whatever pool it has, and is grown to ``kv_memory`` as soon as the memory is there. The memory of
  a dead primary comes back when its process is gone (on CUDA a little after): after a failure the
  growth first waits for the failed primary's processes to be gone and off the GPU (the router
  promotes on the broken streams, 100-200 ms before the pidfd fires on an H200), so it does not ask
  for memory that is still held. A batch engine may be evicted for it (co-serving's memory rule, at
  promotion and not only at relaunch); until the memory is there the engine answers 507 and the
  resize is retried. Nothing waits for it: requests keep flowing.
- a running instance becomes a **standby** again (the old primary after a switchover drained): it
  is shrunk to its standby budget, giving the memory back.

A resize that fails leaves the engine serving with what it has, is logged, retried with backoff and
shown in ``failover status`` (``kv_bytes``, ``kv_target_bytes``); it never stops an engine.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp
import structlog

from failover.coserve.release import descendants, verify_released
from failover.procs.slots import Slot

log = structlog.get_logger(__name__)

RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0
GIVE_UP_S = 120.0  # a growth that memory never allows: logged, status keeps the small pool


class PoolSizer:
    """Resizes slots' pools; one resize task per slot (a newer target replaces an older one)."""

    def __init__(self, token_path: Path, session: Callable[[], aiohttp.ClientSession | None],
                 make_room: Callable[[str], Awaitable[None]], device: str = "cpu") -> None:
        self.token_path = token_path
        self.session = session
        self.make_room = make_room  # evicts lower-priority batch engines for a service's full pool
        self.device = device
        self.tasks: dict[str, asyncio.Task] = {}
        self.failed: dict[str, list[int]] = {}  # service -> its failed primary's pids, until a growth takes them
        self._token: str | None = None

    def primary_failed(self, slot: Slot) -> None:
        """``slot`` was the primary and failed: the instance promoted in its place grows into its
        memory once its processes (tensor-parallel ranks too) are gone."""
        if slot.child is not None:  # gone already (its pidfd came first) or not: on CUDA it may still hold memory
            self.failed[slot.service] = [slot.child.pid, *descendants(slot.child.pid)]

    def want(self, slot: Slot, target: int, why: str, *, since: float | None = None,
             done: Callable[[float], None] | None = None, after_failure: bool = False) -> None:
        """Resize ``slot``'s pool to ``target`` bytes, in the background, retrying until it holds.
        ``done(elapsed_s)`` is called once it does, timed from ``since`` (monotonic; default now).
        ``after_failure``: a promotion in place of a failed primary, whose release it waits for."""
        slot.kv_target = target
        old = self.tasks.pop(slot.name, None)
        if old is not None:
            old.cancel()
        pids = self.failed.pop(slot.service, None) if after_failure else None
        task = asyncio.ensure_future(self._resize(slot, target, why, since or time.monotonic(), done, pids))
        task.set_name(f"kv-{slot.name}")
        self.tasks[slot.name] = task
        task.add_done_callback(lambda t: self.tasks.pop(slot.name, None) if self.tasks.get(slot.name) is t else None)

    async def _resize(self, slot: Slot, target: int, why: str, since: float,
                      done: Callable[[float], None] | None, failed: list[int] | None = None) -> None:
        pid, delay, attempts = slot.pid, RETRY_FIRST_S, 0
        growing = target > (slot.kv_bytes or 0)
        if growing and failed:
            released = await verify_released(failed, self.device)  # bounded: else the retries below
            log.info("failed_primary_released" if released else "failed_primary_not_released", slot=slot.name,
                     service=slot.service, pids=failed, waited_ms=round((time.monotonic() - since) * 1e3, 1))
        while slot.pid == pid and pid is not None:
            attempts += 1
            if growing:
                await self.make_room(slot.service)
            reached, error = await self._post(slot, target)
            if reached is not None:
                # 200: the engine went as far as it may (its pool stays within one full context ..
                # max_batch of them; a shrink stops at a used block); 507 (no memory yet) is retried
                slot.kv_bytes = slot.kv_target = reached
                elapsed = time.monotonic() - since
                log.info("kv_resized", slot=slot.name, service=slot.service, why=why, kv_bytes=reached,
                         requested_bytes=target, attempts=attempts, elapsed_ms=round(elapsed * 1e3, 1))
                if done is not None:
                    done(elapsed)
                return
            if time.monotonic() - since > GIVE_UP_S:
                log.error("kv_resize_gave_up", slot=slot.name, service=slot.service, why=why,
                          kv_bytes=slot.kv_bytes, target_bytes=target, attempts=attempts, error=error,
                          consequence="the engine keeps serving with its current pool")
                return
            if attempts == 1 or attempts % 20 == 0:
                log.warning("kv_resize_retry", slot=slot.name, why=why, kv_bytes=slot.kv_bytes,
                            target_bytes=target, attempts=attempts, error=error)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _post(self, slot: Slot, target: int) -> tuple[int | None, str]:
        """(pool bytes the engine now holds, or None; what went wrong)."""
        session = self.session()
        if session is None:
            return None, "no HTTP session (shutting down)"
        if self._token is None:
            self._token = self.token_path.read_text().strip()
        try:
            async with session.post(slot.url + "/admin/kv", json={"kv_memory": target},
                                    headers={"Authorization": f"Bearer {self._token}"},
                                    timeout=aiohttp.ClientTimeout(total=30)) as r:
                body = await r.json(content_type=None)
                if r.status == 200:
                    return int(body["kv_bytes"]), ""
                message = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
                return None, f"HTTP {r.status}: {message}"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
            return None, repr(e)

    async def stop(self) -> None:
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

"""Evicting a batch engine: cut its requests off, SIGTERM, SIGKILL after ``evict_timeout``, verify the
memory is released, and record the timings.

The runner's requests in flight go back to its queue first, so the engine has nothing to finish and
exits within its short deadline. Released means: the engine and its tensor-parallel ranks are gone
and, on CUDA, none of their pids is listed by ``nvidia-smi --query-compute-apps=pid``.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from failover.coserve.job import PREEMPTED, BatchJob
from failover.coserve.release import descendants, verify_released
from failover.procs import slots

log = structlog.get_logger(__name__)
FORK_WAIT = 10.0  # at most, for a launch between the zygote's fork and its answer


async def evict_engine(job: BatchJob, reason: str, t0: float, device: str) -> None:
    """Evict ``job``'s engine (the caller holds the slot back first); ``t0``: when it was triggered."""
    slot = job.slot
    if job.resume_at is not None:  # resumed, then evicted again before any result
        if "ready_ms" not in job.last_resume and slot.ready_at is not None and slot.ready_at >= job.resume_at:
            job.last_resume["ready_ms"] = round((slot.ready_at - job.resume_at) * 1e3, 1)
        log.info("batch_resumed", service=job.name, evicted_first=True, **job.last_resume)
        job.resume_at = None
    cut = job.runner.interrupt() if job.runner is not None else 0
    task = slot.task
    if task is not None:
        # Never cancel a launch between the zygote's fork and its answer: the forked engine would
        # run unwatched. Forks take milliseconds; the engine is then stopped below like any other.
        deadline = time.monotonic() + FORK_WAIT
        while (slot.state == slots.STARTING and not (slot.child is not None and slot.child.alive)
               and not task.done() and time.monotonic() < deadline):
            await asyncio.sleep(0.005)
        task.cancel()
    child = slot.child
    if child is None or not child.alive:  # between processes (crashed, or never started)
        if not job.ended:
            job.change(PREEMPTED, reason)
        job.preemptions += 1
        job.preempted_for[reason] += 1
        job.last_preempt = {"reason": reason, "pid": None, "cut_off": cut, "no_process": True,
                            "trigger_to_memory_free_ms": round((time.monotonic() - t0) * 1e3, 1)}
        log.info("batch_preempted", service=job.name, **job.last_preempt)
        return
    tree = [child.pid, *descendants(child.pid)]
    evict_timeout = job.svc.batch.evict_timeout
    term_at = time.monotonic()
    code = await slot.stop("preempted", evict_timeout, trigger=reason)
    gone_at = child.exited_at or time.monotonic()
    verified = await verify_released(tree, device)
    verified_at = time.monotonic()
    if not job.ended:
        job.change(PREEMPTED, reason)
    job.preemptions += 1
    job.preempted_for[reason] += 1
    job.last_preempt = {
        "reason": reason, "pid": tree[0], "cut_off": cut, "killed": code == -9,
        "trigger_to_gone_ms": round((gone_at - t0) * 1e3, 1),
        "term_to_gone_ms": round((gone_at - term_at) * 1e3, 1),
        "trigger_to_memory_free_ms": round((verified_at - t0) * 1e3, 1),
        "memory_verified": verified, "deadline_ms": round(evict_timeout * 1e3, 1)}
    log.info("batch_preempted", service=job.name, **job.last_preempt)
    if not verified:
        log.error("batch_memory_not_released", service=job.name, pids=tree,
                  hint="a process of the evicted engine still holds the device; see nvidia-smi")

"""The load trigger of co-serving: a sampler of the watched online services' load, fed to each batch
job's policy every ``sample_interval``.

Load of an online service = its requests waiting for a primary plus those in flight at the router,
and its primary's windowed mean time-to-first-token, read from the engine's own /metrics page.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Protocol

import aiohttp
import structlog
from prometheus_client.parser import text_string_to_metric_families

from failover.coserve.job import BatchJob
from failover.coserve.policy import Decision

log = structlog.get_logger(__name__)


class RouterView(Protocol):
    """The router calls co-serving makes (router.app.Router implements them)."""

    def queue_depth(self, service: str) -> int: ...
    def primary(self, service: str): ...
    async def preempted(self, service: str) -> None: ...
    async def resumed(self, service: str) -> None: ...


class LoadSampler:
    """Samples the load of every watched online service; asks ``act(job, decision)`` to preempt or
    resume a job when its policy says so; ``may_resume(job)`` vetoes a resume (memory not free)."""

    def __init__(self, jobs: dict[str, BatchJob], router: RouterView,
                 act: Callable[[BatchJob, Decision], Awaitable[None]],
                 may_resume: Callable[[BatchJob], bool]) -> None:
        self.jobs, self.router, self.act, self.may_resume = jobs, router, act, may_resume
        self._ttft: dict[str, tuple[int, float, float]] = {}  # instance -> (pid, sum, count) last scraped

    async def run(self) -> None:
        interval = min(j.svc.batch.sample_interval for j in self.jobs.values())
        timeout = aiohttp.ClientTimeout(total=max(interval, 0.5))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await asyncio.sleep(interval)
                live = [j for j in self.jobs.values() if not j.ended]
                if not live:
                    continue
                watched = {name for j in live for name in j.watch}
                load = {name: (self.router.queue_depth(name), await self._ttft_window(session, name))
                        for name in watched}
                now = time.monotonic()
                for job in live:
                    await self._decide(job, now, load)

    async def _decide(self, job: BatchJob, now: float, load: dict) -> None:
        depth = max((load[n][0] for n in job.watch), default=0)
        ttfts = [load[n][1] for n in job.watch if load[n][1] is not None]
        ttft = max(ttfts) if ttfts else None
        if job.policy.preempted and job.policy.reason != "operator" and not self.may_resume(job):
            return  # no resume while the memory it would take is not free (the hold starts after)
        decision = job.policy.observe(now, queue_depth=depth, ttft_s=ttft)
        if decision is Decision.PREEMPT:
            log.info("batch_load_high", service=job.name, queue_depth=depth, ttft_s=ttft)
        if decision is not Decision.NONE:
            await self.act(job, decision)

    async def _ttft_window(self, session: aiohttp.ClientSession, service: str) -> float | None:
        """Mean time-to-first-token of ``service``'s primary since the last sample (None: no request)."""
        inst = self.router.primary(service)
        if inst is None or inst.pid is None:
            return None
        try:
            async with session.get(inst.url + "/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None
        total, count = ttft_totals(text)
        last = self._ttft.get(inst.name)
        self._ttft[inst.name] = (inst.pid, total, count)
        if last is None or last[0] != inst.pid or count <= last[2]:
            return None
        return (total - last[1]) / (count - last[2])


TTFT_FAMILIES = ("failover_engine_time_to_first_token_seconds", "vllm:time_to_first_token_seconds")


def ttft_totals(metrics_text: str) -> tuple[float, float]:
    """(sum of seconds, count) of an engine's time-to-first-token histogram, from its /metrics page
    (the reference engine's, or vLLM's under its own name)."""
    total = count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name in TTFT_FAMILIES:
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count

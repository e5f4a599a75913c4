"""The load trigger of co-serving: a sampler of the watched online services' load, fed to each batch
job's policy every ``sample_interval``.

Load of an online service = its requests waiting for a primary plus those in flight at the router
(or, when more, the requests its engine says are waiting: vLLM's ``vllm:num_requests_waiting``), and
its primary's windowed mean time-to-first-token, read from the engine's own /metrics page: ours
(``failover_engine_time_to_first_token_seconds``) or vLLM's (``vllm:time_to_first_token_seconds``).
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
                load = {}
                for name in watched:
                    ttft, waiting = await self._engine_load(session, name)
                    load[name] = (max(self.router.queue_depth(name), waiting), ttft)
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

    async def _engine_load(self, session: aiohttp.ClientSession, service: str) -> tuple[float | None, int]:
        """Mean time-to-first-token of ``service``'s primary since the last sample (None: no request),
        and the requests its engine reports waiting (0 where it reports none)."""
        inst = self.router.primary(service)
        if inst is None or inst.pid is None:
            return None, 0
        try:
            async with session.get(inst.url + "/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None, 0
        total, count, waiting = engine_totals(text)
        last = self._ttft.get(inst.name)
        self._ttft[inst.name] = (inst.pid, total, count)
        if last is None or last[0] != inst.pid or count <= last[2]:
            return None, waiting
        return (total - last[1]) / (count - last[2]), waiting


# Per engine kind: its time-to-first-token histogram and its gauge of requests waiting.
TTFT_METRICS = frozenset({"failover_engine_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"})
WAITING_METRICS = frozenset({"vllm:num_requests_waiting"})


def ttft_totals(metrics_text: str) -> tuple[float, float]:
    """(sum of seconds, count) of an engine's time-to-first-token histogram, from its /metrics page."""
    total, count, _ = engine_totals(metrics_text)
    return total, count


def engine_totals(metrics_text: str) -> tuple[float, float, int]:
    """(TTFT sum, TTFT count, requests waiting) from an engine's /metrics page, of any kind."""
    total = count = waiting = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name in TTFT_METRICS:
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
        elif family.name in WAITING_METRICS:
            waiting += sum(s.value for s in family.samples)
    return total, count, int(waiting)

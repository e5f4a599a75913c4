"""Co-serving: batch services on the node's spare memory, evicted in well under a second on demand.

One ``BatchJob`` per ``kind = "batch"`` service: its result log, its runner task (feeding the
service's engine slot, which the supervisor forks from the zygote like any other), its
``CoservePolicy`` and its timings. ``Coserver`` owns the jobs and the three triggers:

- operator: ``failover preempt|resume SERVICE`` reach ``Supervisor.preempt|resume`` through the router;
- load: a sampler feeds each job's policy with its watched online services' queue depth (waiting +
  in flight at the router) and their engines' windowed mean time-to-first-token;
- memory: an online launch (a standby relaunch, the replacement after a promotion) that does not
  find its KV budget plus ``memory_margin`` free evicts a lower-priority batch engine first.

Load and memory evictions go through ``Router.preempt`` like an operator's, so the router's roles
(``preempted``) and the admin API's view are the same whoever triggered them. Eviction: the runner's
requests in flight are cut off (they go back to its queue), SIGTERM, SIGKILL after ``evict_timeout``,
then the memory is verified released: the engine and its tensor-parallel ranks are gone and, on
CUDA, none of their pids is listed by ``nvidia-smi --query-compute-apps=pid`` (the supervisor never
creates a CUDA context). A finished batch stops its engine, so the memory goes back to the node.

Job states: ``waiting`` (engine starting) -> ``running`` <-> ``preempted`` -> ``done``; ``failed``
when its files cannot be used (at start, or a result that cannot be written: its engine is stopped);
``failover resume`` of a failed job opens its files again (``retry``) and, when they are usable now,
runs it from where its output stands.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import structlog
from prometheus_client.parser import text_string_to_metric_families

from failover.node import slots
from failover.coserve.batch_io import BatchInputError, BatchOutputError, CorruptOutput, ResultLog, read_items
from failover.coserve.runner import BatchRunner
from failover.config.schema import ServiceConfig, watched_services
from failover.procs import memory
from failover.coserve.policy import CoservePolicy, Decision, PressurePolicy
from failover.coserve.release import descendants, verify_released
from failover.node.slots import Slot
from router import states

if TYPE_CHECKING:
    from failover.node.supervisor import Supervisor

log = structlog.get_logger(__name__)

WAITING, RUNNING, PREEMPTED, DONE, FAILED = "waiting", "running", "preempted", "done", "failed"


class ResumeRefused(Exception):
    """``failover resume`` of a failed batch whose files are still unusable; the message says why."""


@dataclass(slots=True)
class BatchJob:
    svc: ServiceConfig
    slot: Slot
    policy: CoservePolicy
    watch: list[str]
    state: str = WAITING
    results: ResultLog | None = None
    runner: BatchRunner | None = None
    why: str = ""
    preemptions: int = 0
    resumes: int = 0
    last_preempt: dict = field(default_factory=dict)
    last_resume: dict = field(default_factory=dict)
    trigger: tuple[str, float] | None = None  # (reason, monotonic) of a load/memory trigger under way
    resume_at: float | None = None  # monotonic: the resume that has not yet produced a result
    evicting: asyncio.Future | None = None  # set while an eviction runs; memory-triggered callers await it

    @property
    def name(self) -> str:
        return self.svc.name

    def progress(self) -> dict:
        snap = self.runner.progress.snapshot() if self.runner is not None else {}
        return {"state": self.state, "why": self.why or None, "preempted_by": self.policy.reason or None,
                "preemptions": self.preemptions, "resumes": self.resumes,
                "last_preempt": self.last_preempt or None, "last_resume": self.last_resume or None,
                "output": self.svc.batch.output if self.svc.batch else None, **snap}


class Coserver:
    """The batch jobs of one supervisor, their load sampler and the memory check of online launches."""

    def __init__(self, supervisor: "Supervisor") -> None:
        self.sup = supervisor
        self.device = supervisor.config.model.device
        self.jobs: dict[str, BatchJob] = {}
        services = supervisor.config.service
        for svc in services:
            if svc.kind != "batch":
                continue
            b = svc.batch
            assert b is not None, "checked by the config"
            policy = CoservePolicy(PressurePolicy(queue_high=b.queue_high, queue_low=b.queue_low,
                                                  ttft_high_s=b.ttft_high, ttft_low_s=b.ttft_low, hold_s=b.hold))
            slot = supervisor.slots[svc.slot_names()[0]]
            self.jobs[svc.name] = BatchJob(svc, slot, policy, watched_services(svc, services))
        self._ttft: dict[str, tuple[int, float, float]] = {}  # instance -> (pid, sum, count) last scraped
        self._free_memory = lambda: memory.free_bytes(self.device)

    def is_batch(self, service: str) -> bool:
        return service in self.jobs

    # -- start -----------------------------------------------------------------------------------
    def open(self) -> None:
        """Before any engine starts: open every job's files. A job that cannot use them (input
        missing, output not ours, a corrupt result line) fails its service alone, with the reason;
        its engine is never started and the online services start as usual."""
        for job in self.jobs.values():
            self._open(job)

    def _open(self, job: BatchJob) -> bool:
        b = job.svc.batch
        assert b is not None
        try:
            items = list(read_items(Path(b.input)))
            results = ResultLog(Path(b.output), mode=b.output_mode)
        except (BatchInputError, BatchOutputError) as e:
            self._give_up(job, self._explain(job, e))
            return False
        try:
            runner = BatchRunner(items, results, concurrency=b.concurrency,
                                 on_record=lambda rec, job=job: self._recorded(job), model=job.name)
        except BatchOutputError as e:  # the error records of bad input lines could not be written
            results.close()
            self._give_up(job, self._explain(job, e))
            return False
        job.results, job.runner = results, runner
        if runner.remaining == 0:
            job.slot.hold = True  # a restart after the whole input was done: nothing to run
            job.state = DONE
            log.info("batch_already_done", service=job.name, total=runner.progress.total)
        return True

    def _explain(self, job: BatchJob, e: Exception) -> str:
        """The reason a job's files failed it, with what to do about it."""
        if isinstance(e, CorruptOutput):
            return f"{e}: remove or fix line {e.lineno} of {e.path}, then `failover resume {job.name}`"
        return f"{e}; fix that, then `failover resume {job.name}`"

    def retry(self, service: str) -> None:
        """``failover resume`` of a failed batch service: open its files again and, if they are
        usable now, run it (the supervisor's resume then relaunches its engine); if not, it stays
        failed with today's reason and ``ResumeRefused`` says it."""
        job = self.jobs[service]
        if job.state != FAILED:
            return
        if job.results is not None:
            job.results.close()
        job.results = job.runner = None
        job.state = WAITING
        why = self.sup.failed.pop(job.name, None)  # so that a second failure is logged with its reason
        if not self._open(job):
            raise ResumeRefused(f"{job.name} cannot resume: {job.why}")
        if why is not None:
            self.sup.failed[job.name] = why  # the supervisor's resume clears it with its crash-loop count
        job.why = ""
        log.info("batch_retried", service=job.name, done=job.runner.progress.done,
                 total=job.runner.progress.total)
        if job.state != DONE:
            self.sup.background(self._run(job), f"batch-{job.name}")

    def close(self) -> None:
        """At shutdown, after the runners were cancelled: the result files."""
        for job in self.jobs.values():
            if job.results is not None:
                job.results.close()

    def _give_up(self, job: BatchJob, why: str) -> None:
        job.state, job.why = FAILED, why
        job.slot.hold = True
        self.sup.fail_service(job.name, why)

    def start(self) -> None:
        """Once the router serves: a runner task per job, and the load sampler."""
        for job in self.jobs.values():
            if job.state not in (DONE, FAILED):
                self.sup.background(self._run(job), f"batch-{job.name}")
        if self.jobs:  # also while every job is failed: a resume may bring one back
            self.sup.background(self._sample(), "coserve-sampler")

    async def _run(self, job: BatchJob) -> None:
        assert job.runner is not None and job.results is not None
        try:
            snap = await job.runner.run(lambda: self._backend(job))
        except (OSError, ValueError, RuntimeError) as e:  # a result that could not be written (full disk)
            self._give_up(job, self._explain(job, e))
            await self._stop_engine(job, "batch failed")
            return
        job.state = DONE
        self.sup.progress(f"batch {job.name}: done, {snap['done']}/{snap['total']} "
                          f"({snap['errors']} error records) -> {job.svc.batch.output}")
        log.info("batch_done", service=job.name, preemptions=job.preemptions, **snap)
        await self._stop_engine(job, "batch done")
        job.results.close()

    async def _stop_engine(self, job: BatchJob, reason: str) -> None:
        """A finished or failed batch stops its engine: the memory goes back to the node. The router
        stops routing to it as for a preemption (the eviction itself is a no-op once done or failed)."""
        job.slot.hold = True
        if job.name in self.sup.router.services:
            await self.sup.router.preempt(job.name)
        child = job.slot.child
        if child is not None and child.alive:
            if job.slot.state in (slots.RUNNING, slots.STARTING):
                job.slot.change(slots.STOPPING, reason)
            await child.stop(self.sup.sup.stop_timeout)

    async def _backend(self, job: BatchJob) -> str:
        """The batch engine's URL once it serves and is not held back (preempted or stopping)."""
        slot = job.slot
        while not (slot.state == slots.RUNNING and not slot.hold):
            await asyncio.sleep(0.01)
        if job.state == WAITING:
            job.state = RUNNING
        if job.resume_at is not None and "ready_ms" not in job.last_resume and slot.ready_at is not None:
            job.last_resume["ready_ms"] = round((slot.ready_at - job.resume_at) * 1e3, 1)
        return slot.url

    def _recorded(self, job: BatchJob) -> None:
        if job.resume_at is None:
            return
        first = time.monotonic()
        job.last_resume["first_result_ms"] = round((first - job.resume_at) * 1e3, 1)
        log.info("batch_resumed", service=job.name, **job.last_resume)
        job.resume_at = None

    # -- eviction (Supervisor.preempt calls it for a batch service) ------------------------------
    async def evict(self, service: str) -> None:
        job = self.jobs[service]
        reason, t0 = job.trigger if job.trigger is not None else ("operator", time.monotonic())
        job.trigger = None
        if job.state in (DONE, FAILED):
            return
        if reason == "operator":
            job.policy.operator_preempt()
        if job.evicting is not None:  # a second trigger while one eviction runs: the same one
            await job.evicting
            return
        job.evicting = asyncio.get_running_loop().create_future()
        try:
            await self._evict(job, reason, t0)
        finally:
            job.evicting.set_result(None)
            job.evicting = None

    async def _evict(self, job: BatchJob, reason: str, t0: float) -> None:
        slot = job.slot
        slot.hold = True  # first: the runner takes no new request from here on
        if job.resume_at is not None:  # resumed, then evicted again before any result
            if "ready_ms" not in job.last_resume and slot.ready_at is not None and slot.ready_at >= job.resume_at:
                job.last_resume["ready_ms"] = round((slot.ready_at - job.resume_at) * 1e3, 1)
            log.info("batch_resumed", service=job.name, evicted_first=True, **job.last_resume)
            job.resume_at = None
        cut = job.runner.interrupt() if job.runner is not None else 0
        task = self.sup._tasks.get(slot.name)
        if task is not None:
            # Never cancel a launch between the zygote's fork and its answer: the forked engine would
            # run unwatched. Forks take milliseconds; the engine is then stopped below like any other.
            deadline = time.monotonic() + 10.0
            while (slot.state == slots.STARTING and not (slot.child is not None and slot.child.alive)
                   and not task.done() and time.monotonic() < deadline):
                await asyncio.sleep(0.005)
            task.cancel()
        child = slot.child
        if child is None or not child.alive:  # between processes (crashed, or never started)
            job.state = PREEMPTED if job.state != DONE else job.state
            job.preemptions += 1
            job.last_preempt = {"reason": reason, "pid": None, "cut_off": cut, "no_process": True,
                                "trigger_to_memory_free_ms": round((time.monotonic() - t0) * 1e3, 1)}
            log.info("batch_preempted", service=job.name, **job.last_preempt)
            return
        tree = [child.pid, *descendants(child.pid)]
        # A launch still waiting for /ready moves the slot to STOPPING itself when cancelled.
        if slot.state in (slots.RUNNING, slots.STARTING) and task is None:
            slot.change(slots.STOPPING, "preempted", trigger=reason)
        evict_timeout = job.svc.batch.evict_timeout
        term_at = time.monotonic()
        code = await child.stop(evict_timeout)
        gone_at = child.exited_at or time.monotonic()
        verified = await verify_released(tree, self.device)
        verified_at = time.monotonic()
        job.state = PREEMPTED
        job.preemptions += 1
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

    def resumed(self, service: str) -> None:
        """Supervisor.resume of a batch service: note why and when, before its slot relaunches."""
        job = self.jobs[service]
        reason, t0 = job.trigger if job.trigger is not None else ("operator", time.monotonic())
        job.trigger = None
        if reason == "operator":
            job.policy.operator_resume(t0)
        if job.state != PREEMPTED:
            return
        job.state = WAITING  # running again once its engine serves (see _backend)
        job.resumes += 1
        job.resume_at = t0
        job.last_resume = {"reason": reason}

    def holds(self, service: str) -> bool:
        """A batch service whose slot must stay down (done, failed, or preempted)."""
        job = self.jobs.get(service)
        return job is not None and (job.state in (DONE, FAILED) or job.policy.preempted)

    # -- triggers --------------------------------------------------------------------------------
    async def _trigger(self, job: BatchJob, action: str, reason: str) -> None:
        job.trigger = (reason, time.monotonic())
        try:
            if action == "preempt":
                await self.sup.router.preempt(job.name)
            else:
                await self.sup.router.resume(job.name)
        finally:
            job.trigger = None

    async def _sample(self) -> None:
        interval = min(j.svc.batch.sample_interval for j in self.jobs.values())
        timeout = aiohttp.ClientTimeout(total=max(interval, 0.5))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await asyncio.sleep(interval)
                live = [j for j in self.jobs.values() if j.state not in (DONE, FAILED)]
                if not live:
                    continue
                watched = {name for j in live for name in j.watch}
                load = {name: (self._queue_depth(name), await self._ttft_window(session, name)) for name in watched}
                now = time.monotonic()
                for job in live:
                    await self._decide(job, now, load)

    async def _decide(self, job: BatchJob, now: float, load: dict) -> None:
        depth = max((load[n][0] for n in job.watch), default=0)
        ttfts = [load[n][1] for n in job.watch if load[n][1] is not None]
        ttft = max(ttfts) if ttfts else None
        if job.policy.preempted and job.policy.reason != "operator" and not self.memory_fits(job.svc):
            return  # no resume while the memory it would take is not free (the hold starts after)
        decision = job.policy.observe(now, queue_depth=depth, ttft_s=ttft)
        if decision is Decision.PREEMPT:
            log.info("batch_load_high", service=job.name, queue_depth=depth, ttft_s=ttft)
            await self._trigger(job, "preempt", "load")
        elif decision is Decision.RESUME:
            await self._trigger(job, "resume", job.last_preempt.get("reason", "load"))

    def _queue_depth(self, service: str) -> int:
        svc = self.sup.router.services.get(service)
        if svc is None:
            return 0
        return svc.waiting + sum(i.inflight for i in svc.instances.values())

    async def _ttft_window(self, session: aiohttp.ClientSession, service: str) -> float | None:
        """Mean time-to-first-token of ``service``'s primary since the last sample (None: no request)."""
        svc = self.sup.router.services.get(service)
        inst = svc.primary if svc is not None else None
        if inst is None or inst.pid is None or inst.role != states.PRIMARY:
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

    # -- memory ----------------------------------------------------------------------------------
    def memory_fits(self, svc: ServiceConfig, margin: int | None = None) -> bool:
        """Whether one more instance of ``svc`` (its KV budget plus the margin) fits in free memory."""
        if margin is None:
            margin = max((j.svc.batch.memory_margin_bytes for j in self.jobs.values()), default=0)
        free = self._free_memory()
        return free is None or free >= svc.kv_memory_bytes + margin

    async def make_room(self, svc: ServiceConfig) -> None:
        """Before an online instance of ``svc`` launches: evict lower-priority batch engines that
        hold the memory it needs (its KV budget plus ``memory_margin`` not free)."""
        running = [j for j in self.jobs.values() if j.svc.priority < svc.priority
                   and j.slot.child is not None and j.slot.child.alive and j.state != DONE]
        for job in sorted(running, key=lambda j: j.svc.priority):
            if self.memory_fits(svc, job.svc.batch.memory_margin_bytes):
                return
            log.info("batch_memory_needed", service=job.name, for_service=svc.name,
                     need_bytes=svc.kv_memory_bytes + job.svc.batch.memory_margin_bytes,
                     free_bytes=self._free_memory())
            if job.evicting is not None:  # already on its way out
                await job.evicting
                continue
            job.policy.memory_needed()
            await self._trigger(job, "preempt", "memory")

    # -- status ----------------------------------------------------------------------------------
    def status(self) -> dict:
        return {name: job.progress() for name, job in self.jobs.items()}


def ttft_totals(metrics_text: str) -> tuple[float, float]:
    """(sum of seconds, count) of an engine's time-to-first-token histogram, from its /metrics page."""
    total = count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "engine_time_to_first_token_seconds":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count

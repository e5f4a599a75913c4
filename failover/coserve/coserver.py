"""Co-serving: batch services on the node's spare memory, evicted in well under a second on demand.

One ``BatchJob`` per ``kind = "batch"`` service: its result log, its runner task (feeding the
service's engine slot, which the supervisor forks from the zygote like any other), its
``CoservePolicy`` and its timings. ``Coserver`` owns the jobs and the three triggers:

- operator: ``failover preempt|resume SERVICE`` reach ``Supervisor.preempt|resume`` through the
  router's admin API, which stops routing first;
- load: ``load.LoadSampler`` feeds each job's policy with its watched online services' load;
- memory: an online launch (a standby relaunch, the replacement after a promotion) that does not
  find its KV budget plus ``memory_margin`` free evicts a lower-priority batch engine first.

Load and memory evictions are this module's own: it tells the router the service is preempted
(``RouterView.preempted``, so roles and the admin API's view are the same whoever triggered it) and
evicts (``eviction.evict_engine``); a resume starts the slot again through the node's ``release``
and then tells the router (``RouterView.resumed``). A finished or failed batch stops its engine, so
the memory goes back to the node; ``failover resume`` of a failed job opens its files again
(``retry``) and, when they are usable now, runs it from where its output stands.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Coroutine

import structlog

from failover.config.batch_checks import watched_services
from failover.config.schema import Config, ServiceConfig
from failover.coserve.batch_io import BatchInputError, BatchOutputError, CorruptOutput, ResultLog, read_items
from failover.coserve.eviction import evict_engine
from failover.coserve.job import DONE, FAILED, PREEMPTED, RUNNING, WAITING, BatchJob, ResumeRefused
from failover.coserve.load import LoadSampler, RouterView
from failover.coserve.policy import CoservePolicy, Decision, PressurePolicy
from failover.coserve.runner import BatchRunner
from failover.procs import slots
from failover.procs.slots import Slot
from failover.procs import memory

__all__ = ["Coserver", "NodeHooks", "ResumeRefused", "RouterView"]
log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class NodeHooks:
    """What co-serving asks of the node (the supervisor); nothing else of it."""

    spawn: Callable[[Coroutine, str], None]  # a background task the node owns (cancelled at stop)
    fail_service: Callable[[str, str], None]  # give a service up, with the reason
    release: Callable[[str], None]  # the service's slots may run again: start them (restart policy)
    progress: Callable[[str], None]  # a line for the operator


class Coserver:
    """The batch jobs of one node, their load sampler and the memory check of online launches."""

    def __init__(self, config: Config, slot_of: dict[str, Slot], node: NodeHooks, router: RouterView) -> None:
        self.device = config.model.device
        self.stop_timeout = config.supervisor.stop_timeout
        self.node, self.router = node, router
        self.jobs: dict[str, BatchJob] = {}
        for svc in config.service:
            if svc.kind != "batch":
                continue
            b = svc.batch
            assert b is not None, "checked by the config"
            policy = CoservePolicy(PressurePolicy(queue_high=b.queue_high, queue_low=b.queue_low,
                                                  ttft_high_s=b.ttft_high, ttft_low_s=b.ttft_low, hold_s=b.hold))
            slot = slot_of[svc.slot_names()[0]]
            self.jobs[svc.name] = BatchJob(svc, slot, policy, watched_services(svc, config.service))
        self._free_memory = lambda: memory.free_bytes(self.device)

    def is_batch(self, service: str) -> bool:
        return service in self.jobs

    # -- files -----------------------------------------------------------------------------------
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
            job.change(DONE, "already done")
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
        job.change(WAITING, "retry")
        if not self._open(job):
            raise ResumeRefused(f"{job.name} cannot resume: {job.why}")
        job.why = ""
        log.info("batch_retried", service=job.name, done=job.runner.progress.done,
                 total=job.runner.progress.total)
        if job.state != DONE:
            self.node.spawn(self._run(job), f"batch-{job.name}")

    def close(self) -> None:
        """At shutdown, after the runners were cancelled: the result files."""
        for job in self.jobs.values():
            if job.results is not None:
                job.results.close()

    def _give_up(self, job: BatchJob, why: str) -> None:
        job.change(FAILED, "files")
        job.why = why
        job.slot.hold = True
        self.node.fail_service(job.name, why)

    # -- running ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Once the router serves: a runner task per job, and the load sampler."""
        for job in self.jobs.values():
            if not job.ended:
                self.node.spawn(self._run(job), f"batch-{job.name}")
        if self.jobs:  # also while every job is failed: a resume may bring one back
            sampler = LoadSampler(self.jobs, self.router, self._act, self._may_resume)
            self.node.spawn(sampler.run(), "coserve-sampler")

    async def _run(self, job: BatchJob) -> None:
        assert job.runner is not None and job.results is not None
        try:
            snap = await job.runner.run(lambda: self._backend(job))
        except (OSError, ValueError, RuntimeError) as e:  # a result that could not be written (full disk)
            self._give_up(job, self._explain(job, e))
            await self._stop_engine(job, "batch failed")
            return
        job.change(DONE, "every result written")
        self.node.progress(f"batch {job.name}: done, {snap['done']}/{snap['total']} "
                           f"({snap['errors']} error records) -> {job.svc.batch.output}")
        log.info("batch_done", service=job.name, preemptions=job.preemptions, **snap)
        await self._stop_engine(job, "batch done")
        job.results.close()

    async def _stop_engine(self, job: BatchJob, reason: str) -> None:
        """A finished or failed batch stops its engine: the memory goes back to the node. The router
        stops routing to it as for a preemption."""
        job.slot.hold = True
        await self.router.preempted(job.name)
        await job.slot.stop(reason, self.stop_timeout)

    async def _backend(self, job: BatchJob) -> str:
        """The batch engine's URL once it serves and is not held back (preempted or stopping)."""
        slot = job.slot
        while not (slot.state == slots.RUNNING and not slot.hold):
            await asyncio.sleep(0.01)
        if job.state == WAITING:
            job.change(RUNNING, "engine ready")
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

    # -- eviction and resumption -----------------------------------------------------------------
    async def evict(self, service: str, reason: str = "operator", t0: float | None = None) -> None:
        """Evict ``service``'s engine (the router already stopped routing to it)."""
        job = self.jobs[service]
        t0 = time.monotonic() if t0 is None else t0
        if job.ended:
            return
        if reason == "operator":
            job.policy.operator_preempt()
        if job.evicting is not None:  # a second trigger while one eviction runs: the same one
            await job.evicting
            return
        job.evicting = asyncio.get_running_loop().create_future()
        try:
            job.slot.hold = True  # first: the runner takes no new request from here on
            await evict_engine(job, reason, t0, self.device)
        finally:
            job.evicting.set_result(None)
            job.evicting = None

    def resumed(self, service: str, reason: str = "operator", t0: float | None = None) -> None:
        """A resume of a batch service: note why and when, before its slot relaunches."""
        job = self.jobs[service]
        t0 = time.monotonic() if t0 is None else t0
        if reason == "operator":
            job.policy.operator_resume(t0)
        if job.state != PREEMPTED:
            return
        job.change(WAITING, f"resumed: {reason}")  # running again once its engine serves (_backend)
        job.resumes += 1
        job.resume_at = t0
        job.last_resume = {"reason": reason}

    def holds(self, service: str) -> bool:
        """A batch service whose slot must stay down (done, failed, or preempted)."""
        job = self.jobs.get(service)
        return job is not None and (job.ended or job.policy.preempted)

    async def _preempt(self, job: BatchJob, reason: str) -> None:
        """A load or memory trigger: the router stops routing, then the engine is evicted."""
        t0 = time.monotonic()
        await self.router.preempted(job.name)
        await self.evict(job.name, reason, t0)

    async def _resume(self, job: BatchJob, reason: str) -> None:
        self.resumed(job.name, reason)
        if self.holds(job.name):  # done meanwhile, or preempted again by an operator
            return
        self.node.release(job.name)
        await self.router.resumed(job.name)

    async def _act(self, job: BatchJob, decision: Decision) -> None:
        if decision is Decision.PREEMPT:
            await self._preempt(job, "load")
        elif decision is Decision.RESUME:
            await self._resume(job, job.last_preempt.get("reason", "load"))

    # -- memory ----------------------------------------------------------------------------------
    def _may_resume(self, job: BatchJob) -> bool:
        return self.memory_fits(job.svc)

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
            await self._preempt(job, "memory")

    # -- status ----------------------------------------------------------------------------------
    def status(self) -> dict:
        return {name: job.progress() for name, job in self.jobs.items()}


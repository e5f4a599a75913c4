"""Starting one slot's engine: a fork of the zygote (fast), a cold spawn (fallback), a managed vLLM
server (a process tree, failover.node.engine_kinds), or a service's own command (an external
engine), then waiting for its readiness path (/ready; vLLM: /health).

The slot's state moves STOPPED|EXITED -> STARTING -> RUNNING here; a process that never becomes ready
is stopped again before the error goes up. An online service's standby starts
``supervisor.standby_nice`` below the supervisor's CPU priority and gets it back before it counts as
ready (failover.procs.priority): its start leaves the cores to the primary. A batch engine runs
``batch.nice`` below it for its whole life: lowering needs no right, and nothing gives it back.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import aiohttp
import structlog

from failover.config.argv import engine_argv, external_argv
from failover.config.kv import standby_bytes
from failover.config.schema import Config, ServiceConfig
from failover.node.engine_kinds import (kind_of, read_weights_report, vllm_argv, vllm_env, vllm_kv_bytes,
                                        weights_report)
from failover.procs import slots
from failover.procs.slots import Slot
from failover.procs import child as processes
from failover.procs import launch, priority
from failover.procs.child import Child, ChildFailed
from failover.procs.tree import TreeChild, spawn_tree

log = structlog.get_logger(__name__)


class EngineStarter:
    """Starts engines for the supervisor: it owns no process (each Child is the slot's)."""

    def __init__(self, config: Config, zygote: launch.Zygote, *, child_output=None,
                 progress: Callable[[str], None]) -> None:
        self.config, self.sup, self.zygote = config, config.supervisor, zygote
        self.child_output, self.progress = child_output, progress
        self.session: aiohttp.ClientSession | None = None  # opened by the supervisor's start()
        self.cold = False  # set at shutdown: no more forks from the zygote
        self.standby_nice = self.sup.standby_nice
        if self.standby_nice and (why := priority.why_not()) is not None:
            log.warning("standby_priority_off", standby_nice=self.standby_nice, reason=why)
            self.standby_nice = 0

    async def launch(self, slot: Slot, svc: ServiceConfig, reason: str,
                     on_exit: Callable[[Child], None], *, primary: bool) -> None:
        """Start ``slot``'s process and wait for its /ready; raises ChildFailed (process ended).
        A primary (or a batch engine) gets the full KV budget, a standby its small one."""
        kind = kind_of(svc)
        if not kind.resizable_kv:
            kv = vllm_kv_bytes(svc, primary=primary)
        else:
            kv = svc.kv_memory_bytes if primary or svc.kind == "batch" else standby_bytes(svc, self.config.model)
        slot.kv_target, slot.kv_bytes = kv, None
        slot.change(slots.STARTING, reason, launch=self.sup.launch, attempt=slot.launches + 1, kv_bytes=kv)
        slot.launches += 1
        slot.ready_at, slot.ready_info = None, {}
        try:
            child = await self._start_process(slot, svc, on_exit, kv)
        except OSError:
            slot.change(slots.STOPPED, "launch failed")
            raise
        except asyncio.CancelledError:  # preempted or shut down before the process existed
            slot.change(slots.STOPPED, "launch cancelled")
            raise
        slot.child, slot.launched_at = child, time.monotonic()
        lowered = None
        if svc.kind == "online" and not primary:
            lowered = self._lower(slot, child, self.standby_nice, "standby")
        elif svc.kind == "batch" and svc.batch is not None:
            self._lower(slot, child, svc.batch.nice, "batch")  # for good: nothing gives it back
        assert self.session is not None
        ready_path = kind.ready_path if svc.command is None else svc.ready_path
        try:
            info = await processes.wait_http_ready(
                slot.url + ready_path, child, self.sup.ready_timeout, self.session,
                progress=lambda s: self.progress(f"{slot.name}: waiting for /ready ({s:.0f} s)"))
        except (ChildFailed, asyncio.CancelledError):
            await slot.stop("not ready", self.sup.stop_timeout)  # never became ready, or we gave up on it
            raise
        if lowered is not None:
            await self._restore(slot, child, lowered)
        if isinstance(child, TreeChild):
            child.scan()  # its shared-memory files, removed after it (failover.procs.tree)
            # vLLM's /health has no body: its model loader (failover_vllm) reported where its weights came from
            info = read_weights_report(weights_report(self.config, slot.name), svc)
        slot.ready_at, slot.ready_info = time.monotonic(), info
        slot.kv_bytes = info.get("kv_bytes") if isinstance(info.get("kv_bytes"), int) else None
        slot.change(slots.RUNNING, "ready", pid=child.pid, weights_source=info.get("weights_source"),
                    ready_ms=round((slot.ready_at - slot.launched_at) * 1e3, 1))

    def _lower(self, slot: Slot, child: Child, by: int, role: str) -> int | None:
        """``child``'s process group ``by`` below our priority (``role``: "standby" until it is ready,
        "batch" for good); its pgid, or None when left as is."""
        if not by:
            return None
        try:
            pgid, nice = priority.lower(child.pid, by)
        except (OSError, ValueError) as e:  # gone already, or not in a group of its own: as is
            log.warning(f"{role}_priority_not_lowered", slot=slot.name, pid=child.pid, error=str(e))
            return None
        log.info(f"{role}_priority_lowered", slot=slot.name, pid=child.pid, pgid=pgid, nice=nice)
        return pgid

    async def _restore(self, slot: Slot, child: Child, pgid: int) -> None:
        """Our priority back to a ready standby's group. Refused (a right taken away since start):
        it must not serve as a primary that low, so it is stopped and the launch fails; later
        standbys start as they are."""
        try:
            priority.restore(pgid)
        except PermissionError as e:
            log.error("standby_priority_not_restored", slot=slot.name, pid=child.pid, error=str(e))
            self.standby_nice = 0
            await slot.stop("priority not restored", self.sup.stop_timeout)
            raise ChildFailed(f"{slot.name}: its CPU priority could not be restored: {e}") from None
        log.info("standby_priority_restored", slot=slot.name, pid=child.pid, nice=priority.base())

    async def _start_process(self, slot: Slot, svc: ServiceConfig, on_exit, kv: int) -> Child:
        if svc.engine == "vllm":
            report = weights_report(self.config, slot.name)
            report.unlink(missing_ok=True)  # a previous instance's: not this one's word
            argv = vllm_argv(self.config, svc, slot.port, kv, report=report)
            return spawn_tree(slot.name, argv, run_dir=self.config.run_path, env=vllm_env(self.config, svc),
                              own_tmp="TMPDIR" not in svc.engine_env,  # else the operator's, theirs to keep clean
                              on_exit=on_exit, stdout=self.child_output)
        if svc.command is not None:
            return processes.spawn(slot.name, external_argv(self.config, svc, slot.name, slot.port),
                                   on_exit=on_exit, stdout=self.child_output)
        # an online instance's pool never shrinks below a standby's, which may be under one full context
        floor = standby_bytes(svc, self.config.model) if svc.kind == "online" else None
        argv = engine_argv(self.config, svc, slot.port, kv, floor)
        if self.sup.launch == "zygote" and not self.cold:
            if not self.zygote.ready:  # dead or being replaced: do not wait for its imports
                log.warning("zygote_not_ready", slot=slot.name, fallback="spawn")
                return launch.spawn_cold(slot.name, argv, on_exit=on_exit, stdout=self.child_output)
            try:
                return await self.zygote.fork(slot.name, argv, on_exit=on_exit)
            except launch.ZygoteError as e:
                log.error("zygote_fork_failed", slot=slot.name, error=str(e), fallback="spawn")
        return launch.spawn_cold(slot.name, argv, on_exit=on_exit, stdout=self.child_output)

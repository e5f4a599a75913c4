"""Instance slots: the supervisor's side of an engine's life, as an explicit state machine.

A slot is one configured instance of a service (``chat-0`` on port 8101, ``chat-1`` on 8102, ...). Its
process comes and goes (the name and port stay); the router keeps the serving role (primary/standby),
the slot keeps the process state:

    STOPPED  -> STARTING              launched (zygote fork or spawn)
    STARTING -> RUNNING               /ready answered 200
    STARTING -> STOPPED               the launch itself failed (no process)
    STARTING | RUNNING -> EXITED      the process died (crash, kill -9, fenced)
    RUNNING  -> STOPPING              we asked it to go (fence, drain, preempt, shutdown)
    STOPPING -> STOPPED | EXITED      it went
    EXITED   -> BACKOFF -> STARTING   a replacement, after a delay that grows with recent exits
    EXITED | BACKOFF -> STOPPED       not to be replaced (preempted, shutting down)
    *        -> FATAL                 crash loop or no replacement could start: the service failed

Every change goes through :meth:`Slot.change`, which asserts the table and logs one event. Whoever
ends a slot's process does it through :meth:`Slot.stop` (STOPPING, then TERM-then-KILL), saying what
the exit means: HOLD (planned: preempt, shutdown, a finished batch), RECYCLE (planned, and the slot
comes back: an operator's drain) or FAIL (the router's verdict on a hung or broken engine: counted by
the restart policy like a crash).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import structlog

from failover.procs.child import Child

log = structlog.get_logger(__name__)

STOPPED = "stopped"
STARTING = "starting"
RUNNING = "running"
STOPPING = "stopping"
EXITED = "exited"
BACKOFF = "backoff"
FATAL = "fatal"

# State groups, named once.
LIVE = frozenset({STARTING, RUNNING})  # a process of ours is (or is becoming) the slot's engine
DOWN = frozenset({STOPPED, EXITED})  # no process and none on its way: may be started
GIVE_UP = frozenset({EXITED, BACKOFF, STOPPED})  # a failed service's slots in these become FATAL

# What the exit of a stopped process means (see Slot.stop).
HOLD, RECYCLE, FAIL = "hold", "recycle", "fail"

ALLOWED: dict[str, frozenset[str]] = {
    STOPPED: frozenset({STARTING, FATAL}),
    STARTING: frozenset({RUNNING, EXITED, STOPPING, STOPPED, FATAL}),
    RUNNING: frozenset({EXITED, STOPPING, FATAL}),
    STOPPING: frozenset({STOPPED, EXITED, FATAL}),
    EXITED: frozenset({BACKOFF, STARTING, STOPPED, FATAL}),
    BACKOFF: frozenset({STARTING, STOPPED, FATAL}),
    FATAL: frozenset({STARTING}),  # only an operator's resume starts a failed service again
}


@dataclass(slots=True)
class Slot:
    service: str
    name: str
    port: int
    state: str = STOPPED
    child: Child | None = None
    launches: int = 0
    backoffs: int = 0  # replacements that waited in BACKOFF first (failover_supervisor_restart_backoffs_total)
    launched_at: float | None = None  # monotonic, of the current process
    ready_at: float | None = None
    ready_info: dict = field(default_factory=dict)
    evicted_at: float | None = None  # monotonic: when its last process was seen gone
    last_relaunch_s: float | None = None  # eviction -> replacement ready, seconds
    hold: bool = False  # preempted or drained by an operator: do not replace
    task: asyncio.Task | None = None  # its launch or replacement under way (the supervisor's)
    then: str = HOLD  # what the exit of the process being stopped means (HOLD, RECYCLE, FAIL)
    kv_bytes: int | None = None  # its engine's KV pool now (from /ready, then each resize)
    kv_target: int | None = None  # the pool its role calls for (failover.node.kv_pools)
    host: str = "127.0.0.1"  # where its engine listens (Config.engine_host)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None and self.child.alive else None

    def change(self, new: str, reason: str, **fields: object) -> None:
        old = self.state
        assert new in ALLOWED[old], f"slot {self.name}: {old} -> {new} is not allowed"
        self.state = new
        self.backoffs += new == BACKOFF
        log.info("slot_state", slot=self.name, service=self.service, old=old, new=new, reason=reason, **fields)

    def exit_means(self) -> str:
        """What the exit of the slot's process just seen means: a stop's HOLD/RECYCLE/FAIL, or FAIL
        for a process that went without being asked (a crash)."""
        return self.then if self.state == STOPPING else FAIL

    async def stop(self, reason: str, timeout: float, *, then: str = HOLD, **fields: object) -> int | None:
        """End the slot's process: STOPPING (when it is live), then SIGTERM and SIGKILL after
        ``timeout``. ``then`` says what its exit means; returns the exit code (None: no process)."""
        child = self.child
        if child is None or not child.alive:
            return None if child is None else child.returncode
        if self.state in LIVE:
            self.change(STOPPING, reason, **fields)
            self.then = then
        elif then == FAIL:  # a verdict on a process already on its way out: still a failure
            self.then = then
        return await child.stop(timeout)

    async def backoff(self, delay: float) -> None:
        """Wait ``delay`` s before the next start (BACKOFF when the process exited); a cancel (a
        preempt meanwhile) leaves the slot STOPPED, for a later resume to start."""
        if delay <= 0:
            return
        if self.state == EXITED:
            self.change(BACKOFF, "backoff", delay_s=round(delay, 3))
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            if self.state == BACKOFF:
                self.change(STOPPED, "backoff cancelled")
            raise

    def as_json(self) -> dict:
        now = time.monotonic()
        return {"slot": self.name, "state": self.state, "pid": self.pid, "port": self.port,
                "launches": self.launches, "hold": self.hold,
                "uptime_s": round(now - self.launched_at, 1) if self.launched_at and self.pid else None,
                "weights_source": self.ready_info.get("weights_source"),
                "cpu_threads": self.ready_info.get("cpu_threads"),  # the bundled engine's torch threads
                "weights": self.ready_info.get("weights"),  # vLLM: its model loader's report (failover_vllm)
                "kv_bytes": self.kv_bytes, "kv_target_bytes": self.kv_target,
                "last_relaunch_ms": None if self.last_relaunch_s is None else round(self.last_relaunch_s * 1e3, 1)}

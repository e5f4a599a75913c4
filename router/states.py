"""Instance roles as an explicit state machine (Supervisor style: constants, a table, one setter).

    add_instance -> PRIMARY | STANDBY
    STANDBY    -> PRIMARY      promoted (failover or planned switchover)
    PRIMARY    -> DRAINING     planned switchover / drain: no new requests, in-flight ones finish
    DRAINING   -> STANDBY      switchover done, the old primary stays as a hot standby
    DRAINING   -> STOPPED      drain done
    *          -> RELAUNCHING  failed or exited and fenced; a replacement was requested
    *          -> STOPPED      failed with no launcher to relaunch it (standalone), or removed
    *          -> PREEMPTED    co-serving eviction of the whole service
    RELAUNCHING | STOPPED | PREEMPTED -> STANDBY | PRIMARY   re-registered / resumed

Every change goes through :func:`change_role`, which refuses what the table does not allow and emits
exactly one structlog event with the timings the caller measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)

PRIMARY = "primary"
STANDBY = "standby"
RELAUNCHING = "relaunching"
DRAINING = "draining"
PREEMPTED = "preempted"
STOPPED = "stopped"

ROLES = (PRIMARY, STANDBY, RELAUNCHING, DRAINING, PREEMPTED, STOPPED)
INITIAL_ROLES = (PRIMARY, STANDBY)

ALLOWED: dict[str, frozenset[str]] = {
    PRIMARY: frozenset({DRAINING, RELAUNCHING, STOPPED, PREEMPTED}),
    STANDBY: frozenset({PRIMARY, DRAINING, RELAUNCHING, STOPPED, PREEMPTED}),
    DRAINING: frozenset({STANDBY, STOPPED, RELAUNCHING, PREEMPTED}),
    RELAUNCHING: frozenset({STANDBY, PRIMARY, STOPPED}),
    PREEMPTED: frozenset({STANDBY, PRIMARY, STOPPED, RELAUNCHING}),
    STOPPED: frozenset({STANDBY, PRIMARY}),
}

# Roles that receive requests (DRAINING only finishes the ones it already has).
ROUTABLE = frozenset({PRIMARY})
# Roles whose process we expect to be alive and serving; a failure there is news.
WATCHED = frozenset({PRIMARY, STANDBY, DRAINING})
# Roles that hold (or finish) requests: such an instance is removed before it is added again.
SERVING = frozenset({PRIMARY, DRAINING})
# Roles out of service until the instance is registered again (relaunched, re-added, resumed).
OUT_OF_SERVICE = frozenset({RELAUNCHING, STOPPED, PREEMPTED})


class IllegalTransition(AssertionError):
    """A role change the table does not allow: a bug in the caller, never a runtime condition."""


@dataclass(frozen=True, slots=True)
class Transition:
    old: str | None
    new: str
    reason: str
    at: float  # wall clock, for status output

    def as_json(self) -> dict:
        return {"from": self.old, "to": self.new, "reason": self.reason, "at": self.at}


class HasRole(Protocol):
    service: str
    name: str
    role: str
    last_transition: Transition


def check(old: str, new: str) -> None:
    if new not in ALLOWED.get(old, ()):
        raise IllegalTransition(f"role change {old} -> {new} is not allowed "
                                f"(from {old}: {sorted(ALLOWED.get(old, ()))})")


def change_role(inst: HasRole, new: str, reason: str, **timings: float) -> Transition:
    """Move ``inst`` to ``new`` (asserting the table) and emit one ``role_changed`` event."""
    old = inst.role
    check(old, new)
    inst.role = new
    inst.last_transition = Transition(old, new, reason, time.time())
    log.info("role_changed", service=inst.service, instance=inst.name, old=old, new=new,
             reason=reason, **{k: round(v, 3) for k, v in timings.items()})
    return inst.last_transition


def initial(role: str, reason: str = "added") -> Transition:
    if role not in INITIAL_ROLES:
        raise ValueError(f"an instance starts as {' or '.join(INITIAL_ROLES)}, not {role!r}")
    return Transition(None, role, reason, time.time())

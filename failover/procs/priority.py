"""A standby starts at a lower CPU priority, and gets the supervisor's back once it is ready.

A replacement's start (imports, weights, warm-up) competes with the new primary for the node's
cores: on the 2-core bench box it stalled streams that began just after a failover by 0.7-1.2 s
(docs/router.md, "The stall inside a migrated stream"). A lower priority changes nothing when a core
is free; it leaves the cores to the primary when none is.

Linux keeps a nice value per thread, and a new thread or process takes its creator's. Every engine
leads, or sits alone in, a process group of its own (``spawn``: a new session; a zygote fork: the
intermediate's session; vLLM's workers stay in their server's group), so one
``setpriority(PRIO_PGRP)`` reaches every thread of every process of it, both ways.

Going back up needs a right: CAP_SYS_NICE, or an RLIMIT_NICE of at least ``20 - base`` (the
kernel's ``can_nice``; the soft limit is raised to the hard one here). Without it a lowered engine
would stay low after its promotion, so ``why_not()`` is asked before anything is lowered and the
supervisor then starts its standbys as they are (one warning says how to grant it: ``LimitNICE=20``
in a systemd unit, ``ulimit -e 20``, or the capability).
"""

from __future__ import annotations

import os
import resource

from failover_common.proc import has_capability, stat_fields

CAP_SYS_NICE = 23
MAX_NICE = 19


def base() -> int:
    """This process's nice value: what a lowered engine is given back."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def why_not() -> str | None:
    """None when this process may give a lowered engine its own nice value back; else why not."""
    if has_capability(CAP_SYS_NICE):
        return None
    mine = base()
    need = 20 - mine
    soft, hard = resource.getrlimit(resource.RLIMIT_NICE)
    inf = resource.RLIM_INFINITY
    if soft != inf and soft < need and (hard == inf or hard >= need):
        resource.setrlimit(resource.RLIMIT_NICE, (need, hard))
        soft = need
    if soft == inf or soft >= need:
        return None
    return (f"raising a nice value back to {mine} needs CAP_SYS_NICE or RLIMIT_NICE >= {need} "
            f"(it is {soft}, hard limit {hard}): LimitNICE={need} in a systemd unit, or ulimit -e {need}")


def group_of(pid: int) -> int:
    """The process group ``pid`` leads or sits in; refused if it is this process's own."""
    pgid = os.getpgid(pid)
    if pgid == os.getpgrp():
        raise ValueError(f"pid {pid} is in the supervisor's own process group {pgid}")
    return pgid


def set_group(pgid: int, nice: int) -> None:
    """Every thread of every process in group ``pgid`` at ``nice`` (a group that is gone: nothing)."""
    try:
        os.setpriority(os.PRIO_PGRP, pgid, nice)
    except ProcessLookupError:
        pass


def lower(pid: int, by: int) -> tuple[int, int]:
    """Put ``pid``'s process group ``by`` below this process's priority (nice capped at 19); returns
    (the group, for ``restore``; the nice value it now has)."""
    pgid = group_of(pid)
    nice = min(MAX_NICE, base() + by)
    set_group(pgid, nice)
    return pgid, nice


def restore(pgid: int) -> None:
    """Give group ``pgid`` this process's nice value back (PermissionError: no right to, see
    ``why_not``)."""
    set_group(pgid, base())


def nice_of(pid: int) -> list[int]:
    """The nice value of each thread of ``pid`` (/proc/PID/task/TID/stat, field 19)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.append(int(stat_fields(f"/proc/{pid}/task/{tid}/stat")[16]))
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return out

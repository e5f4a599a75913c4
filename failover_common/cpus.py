"""CPU placement: the router on cores of its own, the engines on the others (issue 20).

A router that shares a core with an engine comes back to caches the engine evicted: on the 2-core
bench box its added latency for a one-token completion was 0.21-0.40 ms p50 (1.4-1.8x HAProxy's)
with the kernel's placement and 0.12-0.21 ms (0.9-1.2x HAProxy's, placed the same way) with the
router on one core and the engines on the other (docs/router.md, "A core of its own"). HAProxy's ``cpu-map``, nginx's
``worker_cpu_affinity`` and Kubernetes' static CPU manager exist for the same reason.

A CPU list is the kernel's format (``cpuset(7)``, ``taskset -c``): ``"0"``, ``"0,2"``, ``"0-3,8"``.
Affinity is per thread in Linux, and a new thread or process takes its creator's: ``pin_self`` sets
every thread this process has, and a child given CPUs (``failover.procs.child.spawn``) sets its own
between fork and exec, before it has a second thread.
"""

from __future__ import annotations

import os

import structlog

log = structlog.get_logger(__name__)

MAX_CPU = 8191  # the kernel's CONFIG_NR_CPUS ceiling: a bigger number is a typo


def parse(text: str) -> frozenset[int]:
    """The CPUs of a list such as ``"0-3,8"``; ValueError (saying what is wrong) for anything else."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        if not _number(lo) or (sep and not _number(hi)):
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU number or a range such as 2-5")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first or last > MAX_CPU:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a range of CPUs 0..{MAX_CPU}, low to high")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def _number(part: str) -> bool:
    return part.isascii() and part.isdigit()


def text(cpus) -> str:
    """The kernel's form of a set of CPUs: ``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(_span(run))
            run = []
        run.append(c)
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def check(listed: str, allowed: frozenset[int] | None = None) -> frozenset[int]:
    """The CPUs of ``listed``, all among ``allowed`` (default: this process's); else ValueError."""
    allowed = frozenset(os.sched_getaffinity(0)) if allowed is None else allowed
    mine = parse(listed)
    outside = mine - allowed
    if outside:
        raise ValueError(f"CPU list {listed!r} names CPU(s) {text(outside)} this process may not run on "
                         f"(it may run on {text(allowed)})")
    return mine


def split(router: str, allowed: frozenset[int] | None = None) -> tuple[frozenset[int], frozenset[int]]:
    """(the router's CPUs, everyone else's) for ``router``'s list among ``allowed`` (default: the
    CPUs this process may run on). ValueError when the list names a CPU outside them or leaves none."""
    allowed = frozenset(os.sched_getaffinity(0)) if allowed is None else allowed
    mine = check(router, allowed)
    rest = allowed - mine
    if not rest:
        raise ValueError(f"CPU list {router!r} takes every CPU this node may run on ({text(allowed)}): "
                         "leave at least one for the engines")
    return mine, rest


def pin_self(cpus: frozenset[int]) -> int:
    """Put every thread of this process on ``cpus`` (threads started later take it too); returns
    how many threads were moved. A thread that ended meanwhile is skipped."""
    moved = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            continue
        moved += 1
    return moved


_ENGINES: frozenset[int] | None = None  # place_node's: where every process the node starts runs


def place_node(router: str) -> dict[str, str]:
    """A node's placement, once at its start: this process (the router's loop, and every thread it
    starts later) on ``router``'s CPUs; every process it starts from now on
    (``failover.procs.child.spawn``: the daemon, the zygote and so every engine it forks, a vLLM
    tree) on the others. Returns both lists, for the node's status."""
    global _ENGINES
    mine, rest = split(router)
    _ENGINES = rest
    moved = pin_self(mine)
    placement = {"router": text(mine), "engines": text(rest)}
    log.info("cpus_placed", **placement, threads=moved)
    return placement


def placed() -> frozenset[int] | None:
    """The CPUs ``place_node`` gave the processes this node starts; None: no placement."""
    return _ENGINES

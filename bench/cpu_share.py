"""Who had the CPU around each fault: this bench's processes vs everything else on the machine.

On a shared 2-core box, a client-seen stall can be the bench's own work (the new primary, the
replacement's start) or another user's. ``CpuSampler`` reads /proc/stat (all busy time) and
/proc/PID/stat of our processes (utime + stime) every ``period`` s; ``window`` gives the cores each
side used in [t0, t1]. Instrumentation for bench/failover.py, not a figure of the system.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time
from typing import Callable

HZ = os.sysconf("SC_CLK_TCK")


def _busy_jiffies() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal; no guest (in user)


def _pid_jiffies(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[11]) + int(rest[12])  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return 0


class CpuSampler:
    def __init__(self, ours: Callable[[], list[int]], period: float = 0.02) -> None:
        self.ours, self.period = ours, period
        self.times: list[float] = []
        self.samples: list[tuple[int, int]] = []  # (all busy, ours) jiffies
        self._seen: dict[int, int] = {}  # pid -> last jiffies (a pid gone keeps its last count)

    def _ours_total(self) -> int:
        for pid in self.ours():
            j = _pid_jiffies(pid)
            if j:
                self._seen[pid] = j
        return sum(self._seen.values())

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.times.append(time.monotonic())
            self.samples.append((_busy_jiffies(), self._ours_total()))
            await asyncio.sleep(self.period)

    def window(self, t0: float, t1: float) -> dict:
        """Cores used in [t0, t1] (nearest samples): by all processes, ours, and the others."""
        i = max(0, bisect.bisect_left(self.times, t0) - 1)
        j = min(len(self.times) - 1, bisect.bisect_left(self.times, t1))
        if j <= i:
            return {"all": None, "ours": None, "others": None}
        dt = self.times[j] - self.times[i]
        busy = (self.samples[j][0] - self.samples[i][0]) / HZ / dt
        ours = (self.samples[j][1] - self.samples[i][1]) / HZ / dt
        return {"all": round(busy, 2), "ours": round(ours, 2), "others": round(max(busy - ours, 0.0), 2)}

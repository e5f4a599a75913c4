"""Verifying that an evicted engine's memory is released, and how much memory is free.

Without a CUDA context (the supervisor never creates one): processes through /proc, the GPU through
``nvidia-smi``.
"""

from __future__ import annotations

import asyncio
import os
import time

from failover.procs.memory import gpu_pids
from failover_common.proc import running

VERIFY_TIMEOUT = 5.0  # process tree gone and off the GPU after the engine exited


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (tensor-parallel ranks), from /proc/PID/task/*/children."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


async def verify_released(pids: list[int], device: str, timeout: float = VERIFY_TIMEOUT) -> bool:
    """Every process of an evicted engine is gone and (CUDA) off the GPU; False after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        if not any(running(p) for p in pids):
            if device != "cuda":
                return True
            on_gpu = await asyncio.to_thread(gpu_pids)
            if on_gpu is None or not on_gpu.intersection(pids):
                return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)

"""A process tree shaped like vLLM's, for tests/test_process_tree.py: a leader that starts (spawn
context) a resource tracker and two workers, which create /dev/shm segments and a named semaphore;
one short-lived helper registers a semaphore and exits (nothing maps it afterwards). A worker binds a
unix socket and writes a file in the temp dir, as vLLM's ZMQ sockets and file store."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from multiprocessing import shared_memory


def worker(ready, lock) -> None:
    seg = shared_memory.SharedMemory(create=True, size=1 << 20)
    seg.buf[0] = 1
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(tempfile.gettempdir(), f"{os.getpid()}.sock"))
    with open(os.path.join(tempfile.gettempdir(), f"{os.getpid()}.store"), "wb") as f:
        f.write(b"x")
    ready.release()
    while True:
        time.sleep(1)


def helper(lock) -> None:
    lock.acquire()
    lock.release()


def main() -> None:
    ctx = mp.get_context("spawn")
    ready = ctx.Semaphore(0)
    lock = ctx.Lock()
    workers = [ctx.Process(target=worker, args=(ready, lock), name=f"w{i}") for i in range(2)]
    for w in workers:
        w.start()
    h = ctx.Process(target=helper, args=(lock,))
    h.start()
    h.join()
    for _ in workers:
        ready.acquire()
    print("ready", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())

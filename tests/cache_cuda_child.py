"""Exporter and importer processes for the CUDA arena tests (run with plain python on a GPU).

  export SOCKET SIZE CHUNK   create an arena, fill it with a pattern, send its fds + checksum, exit
                             at once (no unmap, no release: like a crash)
  import FD,.. CHUNKS SUM MODE  map read-only from inherited fds; print the checksum; MODE=write
                             then writes through the mapping (must fail in this process only)
"""

import json
import os
import socket
import sys

import torch

from cache_daemon.arena_cuda import CudaArena


def checksum(t) -> float:
    return float(t.view(torch.float32).double().sum())


def export(sock_path: str, size: int, chunk: int) -> None:
    arena = CudaArena.create(size, 0, chunk)
    flat = arena.flat()
    g = torch.Generator(device="cuda").manual_seed(0)
    flat.view(torch.float32).normal_(generator=g)
    torch.cuda.synchronize()
    fds = arena.export_fds()
    meta = {"sum": checksum(flat), "chunks": list(arena.chunks)}
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock_path)
        socket.send_fds(s, [json.dumps(meta).encode()], fds)
    print("SENT", flush=True)
    os._exit(0)


def import_(fds: str, chunks: str, expect: str, mode: str) -> None:
    arena = CudaArena.import_fds([int(f) for f in fds.split(",")], tuple(int(c) for c in chunks.split(",")), 0)
    flat = arena.flat()
    got = checksum(flat)
    print(json.dumps({"sum": got, "same": got == float(expect)}), flush=True)
    if mode == "write":
        flat[:1024].fill_(7)
        torch.cuda.synchronize()
        print("WRITE WENT THROUGH", flush=True)
    del flat
    arena.close()


if __name__ == "__main__":
    if sys.argv[1] == "export":
        export(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        import_(*sys.argv[2:6])

"""A separate attach process for the cache daemon tests.

usage: cache_child.py MODE SOCKET MODEL DTYPE TP RANKS TRANSFORM [DEVICE]
  hash  attach each rank, print {rank: {name: sha256}} as one JSON line, exit
  hold  like hash, then wait for a line on stdin, hash again from the same mapping, print, exit
  write attach rank, print "ATTACHED", write through a mapped tensor (must die of SIGSEGV)
"""

import hashlib
import json
import sys

from cache_daemon.client import attach
from cache_daemon.fingerprint import make_config


def digests(tensors) -> dict[str, str]:
    import torch

    return {name: hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
            for name, t in tensors.items()}


def main() -> None:
    mode, sock, model, dtype, tp, ranks, transform = sys.argv[1:8]
    device = sys.argv[8] if len(sys.argv) > 8 else "cpu"
    mapped = {}
    for rank in map(int, ranks.split(",")):
        config = make_config(model, dtype=dtype, tp_size=int(tp), tp_rank=rank, transform=transform, device=device)
        mapped[rank] = attach(sock, config, timeout=10)
    print(json.dumps({r: digests(m.tensors) for r, m in mapped.items()}), flush=True)
    if mode == "hold":
        sys.stdin.readline()
        print(json.dumps({r: digests(m.tensors) for r, m in mapped.items()}), flush=True)
    elif mode == "write":
        first = next(iter(mapped.values())).tensors["model.embed_tokens.weight"]
        first.fill_(1.0)  # must fault: the mapping is read-only
        if device == "cuda":
            import torch

            torch.cuda.synchronize()  # the illegal-address error surfaces here
        print("WRITE WENT THROUGH", flush=True)
    for m in mapped.values():
        m.close()


if __name__ == "__main__":
    main()

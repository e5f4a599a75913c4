"""The floor of a relay in Python: the least HTTP a uvloop (or asyncio) relay can do, for
bench/router_micro.py's ``--floor``. Not part of failover, and not a proxy to run.

    python3 bench/relay_floor.py UPSTREAM_PORT PORT [--loop uvloop|asyncio]

One upstream connection per client connection, keep-alive both ways; a message (request or
answer) is its head up to the blank line plus a Content-Length body, found with ``bytes.find`` and
forwarded in one write, unchanged. No chunked bodies, no header rules, no roles, no failover: what
is left is the event loop, the four syscalls and a few lines of Python per request. What the
router adds over this is its own work; what this adds over HAProxy is the loop's.
"""

from __future__ import annotations

import argparse
import asyncio

HOST = "127.0.0.1"


def _message_size(buf: bytes) -> int:
    """The size of the complete message at the start of ``buf``, or -1 if it is not all there."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return -1
    head = buf[:end + 2].lower()
    i = head.find(b"\r\ncontent-length:")
    n = int(head[i + 17:head.find(b"\r\n", i + 2)]) if i >= 0 else 0
    return end + 4 + n if len(buf) >= end + 4 + n else -1


class _Side(asyncio.Protocol):
    """One side of a pair: whole messages in, to the other side's transport."""

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.waiting: list[bytes] = []  # messages before the peer connected

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (n := _message_size(self.buf)) > 0:
            msg, self.buf = self.buf[:n], self.buf[n:]
            if self.peer is None or self.peer.transport is None:
                self.waiting.append(msg)
            else:
                self.peer.transport.write(msg)

    def connection_lost(self, exc) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class _Client(_Side):
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        up = _Side()
        up.peer, self.peer = self, up
        await asyncio.get_running_loop().create_connection(lambda: up, HOST, ARGS.upstream_port)
        for msg in self.waiting:
            up.transport.write(msg)
        self.waiting.clear()


async def _main() -> None:
    server = await asyncio.get_running_loop().create_server(_Client, HOST, ARGS.port)
    print("ready", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("upstream_port", type=int)
    p.add_argument("port", type=int)
    p.add_argument("--loop", default="uvloop", choices=("uvloop", "asyncio"))
    ARGS = p.parse_args()
    if ARGS.loop == "uvloop":
        import uvloop
        uvloop.run(_main())
    else:
        asyncio.run(_main())

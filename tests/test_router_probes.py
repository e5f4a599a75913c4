"""router/health.py's probes go through router/upstream.py's client: one kept-alive connection per
watched instance, reused probe after probe, and closed once the instance is no longer watched."""

from __future__ import annotations

import asyncio

import pytest

from router_helpers import running_router, serve_raw, tolerant, wait_for

pytestmark = pytest.mark.asyncio

READY = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 14\r\n\r\n{"ready":true}'


class ReadyEngine:
    """Answers every request with a 200 /ready; counts connections made, open and probes."""

    def __init__(self) -> None:
        self.made = self.open = self.probes = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.made += 1
        self.open += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.probes += head.startswith(b"GET /ready ")
                writer.write(READY)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()


async def test_probes_reuse_one_connection_and_close_it_when_the_instance_goes():
    a, b = ReadyEngine(), ReadyEngine()
    async with serve_raw(a.serve) as url_a, serve_raw(b.serve) as url_b:
        async with running_router(tolerant(), primary=url_a, standbys=[url_b]) as router:
            await wait_for(lambda: a.probes >= 10 and b.probes >= 10, what="ten probes each")
            # overlapping probes may open a second connection; ten probes on ten would be no reuse
            assert a.made <= 2 and b.made <= 2, (a.made, b.made)
            router.remove_instance("standby-0")
            await wait_for(lambda: b.open == 0, what="the removed instance's probe connection closed")
            seen = b.probes
            await asyncio.sleep(0.3)  # three probe intervals
            assert b.probes == seen and a.probes > 10 and a.open >= 1
        await wait_for(lambda: a.open == 0, what="the router's stop closed the rest")

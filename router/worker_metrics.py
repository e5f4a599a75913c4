"""``/metrics`` of N router workers on one port: whichever worker a scrape reaches answers for all.

A scrape of the shared port lands on one worker (the kernel picks), so a worker's own counters alone
would make every series jump between workers from scrape to scrape. Each worker therefore also
serves its own registry on a private loopback port (``start``; the URL goes into its record in the
role store, which every worker watches), and answers ``/metrics`` with its own samples and every
other live worker's, each sample labelled ``worker="N"``: sum over ``worker`` for the router's
totals (``sum without (worker) (rate(failover_router_requests_total[1m]))``). A worker that does
not answer within ``PEER_TIMEOUT_S`` is left out of that scrape (and counted in
``failover_router_worker_scrape_errors_total``); gauges of roles and readiness are per worker, as
each worker sees them.
"""

from __future__ import annotations

import asyncio

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

log = structlog.get_logger(__name__)

PEER_TIMEOUT_S = 0.5


class _Families:
    def __init__(self, families) -> None:
        self.families = families

    def collect(self):
        return self.families


def labelled(texts: dict[str, str]) -> bytes:
    """Prometheus texts by worker id -> one text, every sample with its ``worker`` label."""
    merged: dict[str, object] = {}
    for worker, text in texts.items():
        for fam in text_string_to_metric_families(text):
            samples = [s._replace(labels={**s.labels, "worker": worker}) for s in fam.samples]
            if fam.name in merged:
                merged[fam.name].samples.extend(samples)
            else:
                fam.samples = samples
                merged[fam.name] = fam
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)


class WorkerMetrics:
    """One worker's side. ``peers()`` gives the other workers' records (id -> record)."""

    def __init__(self, worker: str, render, peers) -> None:
        self.worker, self.render, self.peers = worker, render, peers
        self.url: str | None = None
        self.errors = Counter("failover_router_worker_scrape_errors_total",
                              "another worker's metrics not read for a scrape (it did not answer in time)",
                              ["peer"], registry=None)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        app = web.Application()
        app.add_routes([web.get("/metrics/self", self._self)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/metrics/self"
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PEER_TIMEOUT_S))
        return self.url

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _self(self, request: web.Request) -> web.Response:
        return web.Response(body=self.render())

    async def _peer(self, worker: str, url: str) -> tuple[str, str | None]:
        assert self._session is not None
        try:
            async with self._session.get(url) as r:
                return worker, await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.info("worker_metrics_unread", peer=worker, error=repr(exc))
            return worker, None

    async def all(self) -> bytes:
        """This worker's samples and every other worker's that answers, labelled by worker."""
        peers = {w: rec["metrics_url"] for w, rec in self.peers().items()
                 if w != self.worker and isinstance(rec.get("metrics_url"), str)}
        texts = {self.worker: self.render().decode()}
        for worker, text in await asyncio.gather(*(self._peer(w, u) for w, u in peers.items())):
            if text is None:
                self.errors.labels(worker).inc()
            else:
                texts[worker] = text
        own = generate_latest(_single(self.errors)).decode()
        return labelled(texts) + own.encode()


def _single(metric) -> CollectorRegistry:
    r = CollectorRegistry(auto_describe=False)
    r.register(metric)
    return r

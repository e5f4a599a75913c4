"""Batch progress for people and scrapers: the terminal bar of `failover up`, and /metrics gauges."""

from __future__ import annotations

import asyncio

from prometheus_client.core import GaugeMetricFamily

from failover.coserve.coserver import Coserver
from failover.coserve.job import PREEMPTED


def bar(coserver: Coserver) -> list[str]:
    """One progress line per batch service, for a terminal."""
    lines = []
    for job in coserver.jobs.values():
        p = job.progress()
        total, done = p.get("total") or 0, p.get("done") or 0
        width = 24
        filled = int(width * done / total) if total else width
        eta = p.get("eta_s")
        lines.append(f"batch {job.name} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                     f"{p.get('tokens_per_s', 0):.1f} tok/s ETA {'-' if eta is None else f'{eta:.0f}s'} "
                     f"{job.state}{' (' + job.policy.reason + ')' if job.state == PREEMPTED else ''}")
    return lines


async def report(coserver: Coserver, progress, interval: float = 2.0) -> None:
    """In a terminal: the progress bar every ``interval`` s while it changes, until every batch ends."""
    last: list[str] = []
    while any(not j.ended for j in coserver.jobs.values()):
        await asyncio.sleep(interval)
        lines = bar(coserver)
        if lines != last:
            for line in lines:
                progress(line)
            last = lines


class BatchCollector:
    """Batch progress on the router's /metrics (registered on its registry; read at scrape time)."""

    def __init__(self, coserver: Coserver) -> None:
        self.coserver = coserver

    def describe(self):
        return []

    def collect(self):
        fams = {
            "done": GaugeMetricFamily("failover_batch_done", "Batch requests with a result (errors included)", labels=["service"]),
            "total": GaugeMetricFamily("failover_batch_total", "Batch requests in the input", labels=["service"]),
            "errors": GaugeMetricFamily("failover_batch_errors", "Batch error records (bad lines, 4xx)", labels=["service"]),
            "tokens_per_s": GaugeMetricFamily("failover_batch_tokens_per_second", "Generated tokens per second since start", labels=["service"]),
            "eta_s": GaugeMetricFamily("failover_batch_eta_seconds", "Estimated seconds to finish (-1: unknown)", labels=["service"]),
            "preempted": GaugeMetricFamily("failover_batch_preempted", "1 while the batch engine is evicted", labels=["service"]),
            "preemptions": GaugeMetricFamily("failover_batch_preemptions", "Evictions since start", labels=["service"]),
        }
        for name, job in self.coserver.jobs.items():
            p = job.progress()
            for key, fam in fams.items():
                if key == "preempted":
                    value = 1.0 if job.state == PREEMPTED else 0.0
                else:
                    value = p.get(key)
                    value = -1.0 if value is None else float(value)
                fam.add_metric([name], value)
        return list(fams.values())

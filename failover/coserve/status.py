"""Batch progress for people and scrapers: the terminal bar of `failover up`, and /metrics gauges."""

from __future__ import annotations

import asyncio

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from failover.coserve.coserver import Coserver
from failover.coserve.job import ALLOWED, PREEMPTED

STATES = tuple(ALLOWED)


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
    """Batch progress on the router's /metrics (registered on its registry; read at scrape time).
    Names: docs/metrics.md (the supervisor's prefix; counts of the output file are gauges, since a
    restart reads them back from the file; evictions are a counter, by reason)."""

    def __init__(self, coserver: Coserver) -> None:
        self.coserver = coserver

    def describe(self):
        return []

    def collect(self):
        p, svc = "failover_supervisor_batch_", ["service"]
        fams = {
            "done": GaugeMetricFamily(p + "requests_done", "Batch requests with a result (errors included)", labels=svc),
            "total": GaugeMetricFamily(p + "requests", "Batch requests in the input", labels=svc),
            "errors": GaugeMetricFamily(p + "request_errors", "Batch error records (bad lines, 4xx)", labels=svc),
            "tokens_per_s": GaugeMetricFamily(p + "tokens_per_second", "Generated tokens per second since start", labels=svc),
            "eta_s": GaugeMetricFamily(p + "eta_seconds", "Estimated seconds to finish (-1: unknown)", labels=svc),
            "preempted": GaugeMetricFamily(p + "preempted", "1 while the batch engine is evicted", labels=svc),
        }
        states = GaugeMetricFamily(p + "state", "1 for the batch job's state, 0 for the others",
                                   labels=["service", "state"])
        preemptions = CounterMetricFamily(p + "preemptions", "Evictions of the batch engine since start, by "
                                          "reason (operator, load, memory)", labels=["service", "reason"])
        for name, job in self.coserver.jobs.items():
            p = job.progress()
            for key, fam in fams.items():
                if key == "preempted":
                    value = 1.0 if job.state == PREEMPTED else 0.0
                else:
                    value = p.get(key)
                    value = -1.0 if value is None else float(value)
                fam.add_metric([name], value)
            for state in STATES:
                states.add_metric([name, state], 1.0 if job.state == state else 0.0)
            for reason in sorted({"operator", "load", "memory", *job.preempted_for}):
                preemptions.add_metric([name, reason], float(job.preempted_for[reason]))
        return [*fams.values(), states, preemptions]

"""Prometheus metrics of the router, in its own registry (several routers may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router import states

PREFIX = "failover_router_"
CONTENT_TYPE = CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BLACKOUT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(PREFIX + "requests_total", "Requests answered, by service and status "
                                "code ('stream_error' for a stream that ended in an error event)",
                                ["service", "code"], registry=r)
        self.latency = Histogram(PREFIX + "proxy_latency_seconds", "Time from request received to "
                                 "the first byte sent to the client (retries and queueing included)",
                                 ["service"], buckets=LATENCY_BUCKETS, registry=r)
        self.failovers = Counter(PREFIX + "failovers_total", "Primary changes, by reason "
                                 "(exited, probe, connect, reset, garbage, stall, planned, ...)",
                                 ["service", "reason"], registry=r)
        self.blackout = Histogram(PREFIX + "failover_blackout_seconds", "Unplanned failover: last good "
                                  "response of the old primary to the first good response of the new",
                                  ["service"], buckets=BLACKOUT_BUCKETS, registry=r)
        self.migrations = Counter(PREFIX + "migrations_total", "Streams re-issued on another instance "
                                  "after tokens were sent", ["service"], registry=r)
        self.stream_reads = Counter(PREFIX + "stream_reads_total", "Upstream reads of the streams answered "
                                    "in full, by how they were relayed: 'lane' (one chunk of one event, sent "
                                    "as it came, inspected later) or 'parsed' (httptools and the SSE scan)",
                                    ["service", "way"], registry=r)
        self.retries = Counter(PREFIX + "retries_total", "Requests re-sent before any byte reached "
                               "the client", ["service"], registry=r)
        self.up = Gauge(PREFIX + "backend_up", "1 while the instance's last health verdict is ready",
                        ["service", "backend"], registry=r)
        self.role = Gauge(PREFIX + "backend_role", "1 for the instance's current role, 0 for the others",
                          ["service", "backend", "role"], registry=r)
        self.queued = Gauge(PREFIX + "queued_requests", "Requests waiting for a ready primary",
                            ["service"], registry=r)
        self.loop_lag = Histogram(PREFIX + "loop_lag_seconds", "How late the router's event loop ran a "
                                  "20 ms timer (its own stalls, which must never count against engines)",
                                  buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
                                  registry=r)
        self.probes_discounted = Counter(PREFIX + "probes_discounted_total", "Probe timeouts not counted "
                                         "because the router's own loop stalled meanwhile",
                                         ["service", "backend"], registry=r)
        self.saturated = Counter(PREFIX + "saturated_total", "Requests answered 503 because the primary "
                                 "had max_upstream in flight and its router-side queue was full",
                                 ["service"], registry=r)
        self.buffered = Gauge(PREFIX + "buffered_body_bytes", "Bytes of request bodies held now "
                              "(against max_buffered_bytes)", registry=r)

    def set_role(self, service: str, instance: str, role: str) -> None:
        for r in states.ROLES:
            self.role.labels(service, instance, r).set(1.0 if r == role else 0.0)

    def set_up(self, service: str, instance: str, up: bool) -> None:
        self.up.labels(service, instance).set(1.0 if up else 0.0)

    def forget(self, service: str, instance: str) -> None:
        for r in states.ROLES:
            self.role.remove(service, instance, r)
        self.up.remove(service, instance)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The supervisor's own metrics on the node router's /metrics: daemon and zygote liveness, each
slot's process state, relaunches and restart backoffs, failed services.

Read at scrape time from the objects that already hold the state (no second bookkeeping to drift):
counts that only grow (restarts, relaunches, backoffs, hangs) are exposed as counters. Names follow
docs/metrics.md (prefix ``failover_supervisor_``, counters end in ``_total``, seconds).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from failover.node.daemon import CacheDaemon
from failover.procs import slots as slot_states
from failover.procs.launch import Zygote
from failover.procs.liveness import Watchdog
from failover.procs.slots import Slot

PREFIX = "failover_supervisor_"
SLOT_STATES = (slot_states.STOPPED, slot_states.STARTING, slot_states.RUNNING, slot_states.STOPPING,
               slot_states.EXITED, slot_states.BACKOFF, slot_states.FATAL)


class SupervisorCollector:
    """A prometheus_client custom collector over the supervisor's parts (registered on the router's
    registry: one process, one scrape). ``failed`` maps a given-up service to why."""

    def __init__(self, daemon: CacheDaemon, zygote: Zygote, slots: Mapping[str, Slot],
                 failed: Mapping[str, str], watchdogs: Sequence[Watchdog], services: Sequence[str]) -> None:
        self.daemon, self.zygote, self.slots, self.failed = daemon, zygote, slots, failed
        self.watchdogs, self.services = watchdogs, services
        self.started = time.time()

    def describe(self):
        return []  # collected lazily: describing would run collect() at registration

    def collect(self):
        p = PREFIX
        yield _gauge(p + "start_time_seconds", "Unix time the supervisor started", [((), self.started)])
        d, z = self.daemon, self.zygote
        yield _gauge(p + "daemon_up", "1 while the cache daemon's process runs (managed) or its ready "
                     "file is there (external)", [((), float(d.ready if not d.managed else
                                                         d.child is not None and d.child.alive))])
        yield _gauge(p + "daemon_ready", "1 while the cache daemon holds the weights resident (ready)",
                     [((), float(d.ready))])
        yield _counter(p + "daemon_restarts", "Cache daemon restarts after it died or hung", [((), d.restarts)])
        yield _gauge(p + "zygote_up", "1 while the zygote runs and has said hello", [((), float(z.ready))])
        yield _counter(p + "zygote_restarts", "Zygote restarts", [((), max(z.restarts, 0))])
        yield _counter(p + "hangs", "Silent daemon or zygote found by a liveness ping and killed, by process",
                       [((dog.event.removesuffix("_hung"),), dog.hangs) for dog in self.watchdogs], ["process"])
        state = GaugeMetricFamily(p + "slot_state", "1 for the instance slot's process state, 0 for the "
                                  "others", labels=["service", "slot", "state"])
        launches, backoffs, relaunch = [], [], []
        for slot in self.slots.values():
            for s in SLOT_STATES:
                state.add_metric([slot.service, slot.name, s], 1.0 if slot.state == s else 0.0)
            launches.append(((slot.service, slot.name), max(slot.launches - 1, 0)))
            backoffs.append(((slot.service, slot.name), slot.backoffs))
            if slot.last_relaunch_s is not None:
                relaunch.append(((slot.service, slot.name), slot.last_relaunch_s))
        yield state
        labels = ["service", "slot"]
        yield _counter(p + "relaunches", "Engine processes started after a slot's first (crash, fence, "
                       "drain, resume)", launches, labels)
        yield _counter(p + "restart_backoffs", "Relaunches that waited a backoff delay first (repeated "
                       "exits within the crash-loop window)", backoffs, labels)
        yield _gauge(p + "last_relaunch_seconds", "The slot's last relaunch: its process gone -> the "
                     "replacement ready", relaunch, labels)
        yield _gauge(p + "service_failed", "1 while the service is given up (crash loop, relaunch "
                     "failed) until `failover resume`", [((s,), float(s in self.failed)) for s in self.services],
                     ["service"])


def _gauge(name: str, doc: str, values, labels=()) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=list(labels))
    for key, value in values:
        fam.add_metric(list(key), float(value))
    return fam


def _counter(name: str, doc: str, values, labels=()) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, doc, labels=list(labels))  # exposed as NAME_total
    for key, value in values:
        fam.add_metric(list(key), float(value))
    return fam

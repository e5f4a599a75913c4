"""What ``failover status`` shows of a node: the router's document plus the supervisor's view
(per-instance uptime, weight source and KV pool, slots, daemon, zygote, failed services, batch).

Functions of the running ``Supervisor`` (``self``) (its methods ``_describe`` and ``status`` call these).
"""

from __future__ import annotations

import os
import time


def describe(self, doc: dict) -> dict:
    """The router's status plus the node's: per-instance uptime and weight source, slots,
    daemon, zygote, failed services, batch progress."""
    now = time.monotonic()
    for svc in doc["services"]:
        if svc["name"] in self.failed:
            svc["state"] = "failed: " + self.failed[svc["name"]]
        if svc["name"] in self.coserve.jobs:
            svc["batch"] = self.coserve.jobs[svc["name"]].progress()
        for inst in svc["instances"]:
            slot = self.slots.get(inst["name"])
            if slot is not None and slot.pid is not None and slot.launched_at is not None:
                inst["uptime_s"] = round(now - slot.launched_at, 1)
                inst["weights_source"] = slot.ready_info.get("weights_source")
                inst["kv_bytes"], inst["kv_target_bytes"] = slot.kv_bytes, slot.kv_target
    for record in (doc.get("last_failover") or {}).values():
        grown = self.kv_grown.get(record.get("new"))
        if grown is not None:
            record["kv_grown_ms"] = grown
    doc["supervisor"] = node_status(self)
    return doc

def node_status(self) -> dict:
    zyg, daemon = self.zygote, self.daemon
    return {
        "pid": os.getpid(), "uptime_s": round(time.monotonic() - self.started_at, 1),
        "launch": self.sup.launch,
        "daemon": {"managed": daemon.managed, "ready": daemon.ready,
                   "pid": daemon.child.pid if daemon.child and daemon.child.alive else None,
                   "restarts": daemon.restarts, "incidents": daemon.incidents[-5:]},
        "zygote": {"pid": zyg.child.pid if zyg.alive else None, "restarts": max(zyg.restarts, 0)},
        **({"cpus": self.placement} if self.placement else {}),
        "failed": dict(self.failed),
        "slots": [slot.as_json() for slot in self.slots.values()],
        "batch": self.coserve.status(),
        **({"cluster": self.cluster.status()} if self.cluster is not None else {}),
    }

"""The status page's timeline of the last failovers: detect, switch, first good response, relaunch.

The promoter keeps the record of each completed unplanned failover (``Promoter.history``) and of the
one still open (``Promoter.pending``: switched, no good response from the new primary yet); this
adds the moment the evicted instance came back ready as a standby, seen as its role change
``relaunching -> standby``. Times are the router's monotonic clock, shown as wall-clock instants
(converted once per document) and as milliseconds after the detection.
"""

from __future__ import annotations

import collections
import time

from router import states

SHOWN = 10  # failovers in one document, newest first


class Timeline:
    def __init__(self, promoter) -> None:
        self.promoter = promoter  # router.promotion.Promoter (read only)
        self.back: collections.deque[tuple[str, float]] = collections.deque(maxlen=64)  # (instance, monotonic)

    def role_changed(self, inst, old: str, new: str, reason: str) -> None:
        """Router.watch_roles listener: note a relaunched instance that is ready again."""
        if old == states.RELAUNCHING and new == states.STANDBY:
            self.back.append((inst.name, time.monotonic()))

    def entries(self) -> list[dict]:
        """The last failovers, newest first, each: service, old, new, reason, ``at`` (unix time of the
        detection) and ms after the detection of ``switch``, ``first_ok`` and ``relaunch_ready``
        (None while not yet), plus ``detect_ms`` (last good response of the old primary -> detection)."""
        wall = time.time() - time.monotonic()  # add to a monotonic instant to get unix time
        rows = []
        for service, rec in self.promoter.history:
            m = rec["monotonic"]
            rows.append(self._row(service, rec["old"], rec["new"], rec["reason"], m["last_ok"], m["detected"],
                                  m["switched"], m["first_ok"], wall, rec.get("kv_grown_ms")))
        for service, p in self.promoter.pending.items():
            rows.append(self._row(service, p.old, p.new, p.reason, p.last_ok, p.detected, p.switched, None,
                                  wall, None))
        rows.sort(key=lambda r: r["at"], reverse=True)
        return rows[:SHOWN]

    def _row(self, service, old, new, reason, last_ok, detected, switched, first_ok, wall, kv_grown_ms) -> dict:
        back = next((t for name, t in self.back if name == old and t > detected), None)
        after = lambda t: None if t is None else round((t - detected) * 1e3, 1)
        return {"service": service, "old": old, "new": new, "reason": reason,
                "at": round(detected + wall, 3), "detect_ms": round((detected - last_ok) * 1e3, 1),
                "switch_ms": after(switched), "first_ok_ms": after(first_ok),
                "blackout_ms": None if first_ok is None else round((first_ok - last_ok) * 1e3, 1),
                "relaunch_ready_ms": after(back), "kv_grown_ms": kv_grown_ms}

"""``failover status`` for a cluster: the nodes and their lease age, every instance with its node and
role, and which router saw what (the ``cluster`` part of a router's status document)."""

from __future__ import annotations

import time


def _table(cols: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    out = ["  ".join(c.upper().ljust(w) for c, w in zip(cols, widths)).rstrip()]
    return out + ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


def _age(at, now: float) -> str:
    return f"{max(0.0, now - at):.1f}s" if isinstance(at, (int, float)) and at else "-"


def cluster_lines(c: dict, now: float | None = None) -> list[str]:
    now = time.time() if now is None else now
    holders = c.get("holders") or {}
    head = (f"cluster: router {c.get('router')}" + (f" on node {c['node']}" if c.get("node") else "")
            + f", etcd contact {c.get('contact_age_s', '-')}s ago, revision {c.get('revision', '-')}"
            + (", ROUTING HELD (etcd unreachable)" if c.get("held") else ""))
    lines = [head]
    nodes = c.get("nodes") or {}
    lines += _table(("node", "host", "lease age", "ttl", "registered", "fingerprint"), [
        (name, str(n.get("host", "")), _age(n.get("at"), now), f"{n.get('ttl', '-')}s",
         f"{_age(n.get('registered_at'), now)} ago (#{n.get('registrations', 1)})",
         str((n.get("fingerprint") or {}).get("key", "-")))
        for name, n in sorted(nodes.items())])
    rows = []
    for ident, rec in sorted((c.get("instances") or {}).items()):
        svc = rec.get("service", "")
        holder = holders.get(svc) or {}
        cluster_role = "primary" if holder.get("instance") == ident else "standby"
        alive = "" if rec.get("node") in nodes else " (node gone)"
        rows.append((svc, ident, str(rec.get("node", "")), cluster_role + alive, str(rec.get("role", "")),
                     "yes" if rec.get("ready") else "no", str(rec.get("url", ""))))
    lines += ["", *_table(("service", "instance", "node", "cluster role", "node's view", "ready", "url"), rows)]
    lines += ["", *_table(("service", "primary in etcd", "revision (fencing token)", "written by"), [
        (s, str(h.get("instance")), str(h.get("revision")), str(h.get("by") or "-"))
        for s, h in sorted(holders.items())])]
    lines += [f"NOT PROMOTED {ident}: {why}" for ident, why in sorted((c.get("not_promoted") or {}).items())]
    routers = c.get("routers") or {}
    lines += ["", *_table(("router", "pid", "url", "seen", "routing to", "record age"), [
        (rid, str(r.get("pid") or "-"), str(r.get("url") or "-"),
         ", ".join(f"{s}: {v.get('primary')} @{v.get('revision')}" for s, v in (r.get("seen") or {}).items()) or "-",
         (", ".join(f"{s}: {v}" for s, v in (r.get("routing") or {}).items()) or "-")
         + (" (HELD)" if r.get("held") else ""), _age(r.get("at"), now))
        for rid, r in sorted(routers.items())])]
    return lines

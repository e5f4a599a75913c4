"""``failover status|promote|drain|preempt|resume``: thin clients of the router's admin API.

The router is found from the node config (``--config``: its router address and admin token file) or
given directly (``--url`` and ``--token-file``). Every refusal of the router (a promotion to an
unready standby, a drain of an unknown instance) is printed as the router worded it, exit code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from failover.cluster.status import cluster_lines
from failover.config.schema import ConfigError, load_config


class AdminError(Exception):
    """A request the router refused or could not answer; the message says what to do."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    name, rest = argv[0], argv[1:]
    p = argparse.ArgumentParser(prog=f"failover {name}")
    where = p.add_argument_group("where the router is (one of)")
    where.add_argument("--config", type=Path, help="the node config that `failover up` runs")
    where.add_argument("--url", help="router base URL, e.g. http://127.0.0.1:8000")
    where.add_argument("--token-file", type=Path, help="admin token file (with --url)")
    p.add_argument("--http-timeout", type=float, default=30.0, help="seconds to wait for the router's answer")
    if name == "status":
        p.add_argument("--json", action="store_true", help="print the router's status document")
    elif name == "promote":
        p.add_argument("service", nargs="?", help="service (default: the first one)")
        p.add_argument("--to", dest="to", help="the standby instance to promote (default: the router's pick)")
    elif name == "drain":
        p.add_argument("instance", help="instance name, e.g. chat-0 (see `failover status`)")
        p.add_argument("--timeout", dest="drain_timeout", type=float, default=None,
                       help="seconds to wait for its in-flight requests (default: the router's drain_timeout)")
    else:  # preempt, resume
        p.add_argument("service", help="the (batch) service")
        if name == "preempt":
            p.add_argument("--force", action="store_true",
                           help="preempt an online service too: stops its primary and standbys; its clients "
                                "get 503 until `failover resume`")
    a = p.parse_args(rest)
    a.command = name
    if a.config is None and a.url is None:
        p.error("say where the router is: --config CONFIG, or --url URL --token-file FILE")
    if a.config is not None and a.url is not None:
        p.error("give --config or --url, not both")
    return a


def locate(a: argparse.Namespace) -> tuple[str, str]:
    """(base URL, bearer token) of the router."""
    if a.config is not None:
        config = load_config(a.config)
        url, token_path = config.router_url, config.token_path
    else:
        url, token_path = a.url.rstrip("/"), a.token_file
    token = ""
    if token_path is not None:
        try:
            token = token_path.read_text().strip()
        except FileNotFoundError:
            raise AdminError(f"no admin token at {token_path}: is `failover up` running with this config?") from None
        except PermissionError:
            raise AdminError(f"cannot read {token_path}: run as the user that runs `failover up`") from None
    return url, token


def call(url: str, token: str, method: str, path: str, body: dict | None, timeout: float) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        with e:
            raw = e.read()
        try:
            err = json.loads(raw).get("error", {})
            message = err.get("message") if isinstance(err, dict) else str(err)
        except (json.JSONDecodeError, AttributeError):
            message = raw.decode(errors="replace").strip()[:300]
        if e.code == 401:
            message = f"{message or 'unauthorized'} (is the token file the one the router uses?)"
        raise AdminError(f"refused ({e.code}): {message or e.reason}") from None
    except urllib.error.URLError as e:
        raise AdminError(f"cannot reach the router at {url}: {e.reason}; is `failover up` running?") from None
    except TimeoutError:
        raise AdminError(f"the router at {url} did not answer within {timeout:.0f} s") from None


def instances(doc: dict) -> list[dict]:
    """Flatten the status document into rows (one per instance), whatever its nesting."""
    rows: list[dict] = []
    services = doc.get("services", [])
    if isinstance(services, dict):
        services = [dict(v, name=k) for k, v in services.items()]
    for svc in services:
        insts = svc.get("instances", [])
        if isinstance(insts, dict):
            insts = [dict(v, name=k) for k, v in insts.items()]
        rows += [dict(i, service=i.get("service", svc.get("name", ""))) for i in insts]
    return rows


def render_table(doc: dict) -> str:
    cols = ("service", "instance", "role", "pid", "url", "ready", "uptime", "kv")
    rows = []
    for inst in instances(doc):
        uptime = inst.get("uptime_s", inst.get("uptime"))
        rows.append((
            str(inst.get("service", "")), str(inst.get("name", "")), str(inst.get("role", "")),
            str(inst.get("pid") or "-"), str(inst.get("url", "")),
            "yes" if inst.get("ready") else "no",
            _duration(uptime) if isinstance(uptime, (int, float)) else "-",
            _pool(inst.get("kv_bytes"), inst.get("kv_target_bytes")),
        ))
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines += [f"{i.get('name')}: its vLLM leaks a prompt cut inside a character, so a stream broken inside one "
              "may end in an error; install failover in that vLLM's environment (docs/vllm.md)"
              for i in instances(doc) if i.get("cut_leak")]
    for svc in doc.get("services", []) if isinstance(doc.get("services"), list) else []:
        state = svc.get("state") or svc.get("status")
        if state and state not in ("ok", "serving"):
            lines.append(f"service {svc.get('name')}: {state}")
        if isinstance(svc.get("batch"), dict):
            lines.append(batch_line(svc["name"], svc["batch"]))
    placed = (doc.get("supervisor") or {}).get("cpus")
    if isinstance(placed, dict):  # router.cpus
        lines.append(f"cpus: router {placed.get('router')}, engines {placed.get('engines')}")
    if isinstance(doc.get("cluster"), dict):
        lines += ["", *cluster_lines(doc["cluster"])]
    return "\n".join(lines)


def batch_line(name: str, b: dict) -> str:
    """``batch offline: running, 37/100 done (2 errors), 52.1 tok/s, ETA 12s, 3 preemptions``"""
    total, done = b.get("total"), b.get("done")
    parts = [f"batch {name}: {b.get('state')}" + (f" ({b['preempted_by']})" if b.get("state") == "preempted" else "")]
    if total is not None:
        parts.append(f"{done}/{total} done" + (f" ({b['errors']} errors)" if b.get("errors") else ""))
        parts.append(f"{b.get('tokens_per_s', 0):.1f} tok/s")
        eta = b.get("eta_s")
        parts.append("ETA " + ("-" if eta is None else _duration(eta)))
    parts.append(f"{b.get('preemptions', 0)} preemptions")
    if b.get("why"):
        parts.append(b["why"])
    return ", ".join(parts)


def _first_service(doc: dict, instance: str | None) -> str:
    """The service of ``instance`` when given, else the first one (as the router routes)."""
    rows = instances(doc)
    for row in rows:
        if instance is not None and row.get("name") == instance:
            return row["service"]
    if instance is not None:
        raise AdminError(f"unknown instance {instance!r}; known: {sorted(r.get('name') for r in rows)}")
    services = doc.get("services") or []
    if not services:
        raise AdminError("the router has no services yet")
    first = services[0]
    return first["name"] if isinstance(first, dict) else str(first)


def _pool(now, target) -> str:
    """``64.0MiB``, or ``4.0MiB->64.0MiB`` while a pool grows (or shrinks) toward its target."""
    if not isinstance(now, int):
        return "-"
    size = lambda n: f"{n / (1 << 20):.1f}MiB" if n < 1 << 30 else f"{n / (1 << 30):.2f}GiB"
    return size(now) if not isinstance(target, int) or target == now else f"{size(now)}->{size(target)}"


def _duration(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def run(a: argparse.Namespace) -> int:
    url, token = locate(a)
    t = a.http_timeout
    if a.command == "status":
        doc = call(url, token, "GET", "/admin/status", None, t)
        print(json.dumps(doc, indent=2) if a.json else render_table(doc))
        return 0
    if a.command == "promote":
        service = a.service or _first_service(call(url, token, "GET", "/admin/status", None, t), a.to)
        body = {"service": service} | ({"to": a.to} if a.to else {})
    elif a.command == "drain":
        body = {"instance": a.instance} | ({"timeout": a.drain_timeout} if a.drain_timeout is not None else {})
        t = max(t, (a.drain_timeout or 0) + 10)
    else:
        body = {"service": a.service} | ({"force": True} if getattr(a, "force", False) else {})
        if body.get("force"):
            print(f"preempt --force: stopping every engine of {a.service!r}; its clients get 503 until "
                  f"`failover resume {a.service}`", file=sys.stderr)
    start = time.monotonic()
    doc = call(url, token, "POST", f"/admin/{a.command}", body, t)
    summary = doc.get("message") or ", ".join(f"{k}={v}" for k, v in doc.items() if not isinstance(v, (dict, list)))
    print(f"{a.command}: ok ({time.monotonic() - start:.2f} s){': ' + summary if summary else ''}")
    return 0


def main(argv: list[str]) -> int:
    if not argv:
        print("failover admin: expected a command name", file=sys.stderr)
        return 2
    a = parse_args(argv)
    try:
        return run(a)
    except ConfigError as e:
        print(f"failover {a.command}: {e}", file=sys.stderr)
        return 2
    except AdminError as e:
        print(f"failover {a.command}: {e}", file=sys.stderr)
        return 1

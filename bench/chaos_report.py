"""The chaos soak's report: the figures from what the clients, the faults and the node recorded
(``build``), and their printed form (``render``). See bench/chaos.py and docs/chaos.md."""

from __future__ import annotations

import bisect
import os
import sys

from client_figures import fault_figures, percentile, summarize
from client_figures import line as client_line
from loadgen import Outcome

FAULT_WINDOW = 2.0  # a request overlapping [fault, fault + 2 s] counts as "during a fault"


def _pct(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": round(percentile(values, 50) * 1e3, 1) if values else None,
            "p99_ms": round(percentile(values, 99) * 1e3, 1) if values else None}


def build(s, load, sdk, quitters, m0: dict, m1: dict, quiesce: dict, elapsed: float, use_batch: bool) -> dict:
    """``s``: the chaos.Soak (faults, daemon checks); ``load``/``sdk``/``quitters``: the clients;
    ``m0``/``m1``: the router's metrics before and after; ``quiesce``: chaos.wait_quiet's answer."""
    by_start = sorted(s.faults, key=lambda f: f.at)
    starts = [f.at for f in by_start]

    def during(o: Outcome) -> bool:  # some fault f with [o.start, o.end] overlapping [f, f + window]
        return bisect.bisect_right(starts, o.end) > bisect.bisect_left(starts, o.start - FAULT_WINDOW)

    def kinds_during(o: Outcome) -> set[str]:
        lo, hi = bisect.bisect_left(starts, o.start - FAULT_WINDOW), bisect.bisect_right(starts, o.end)
        return {f.kind for f in by_start[lo:hi]}

    def last_fault(o: Outcome) -> str:
        i = bisect.bisect_right(starts, o.end)
        return by_start[i - 1].kind if i and o.end - starts[i - 1] < 15.0 else "no fault within 15 s"

    everything = [("raw", o) for o in load.outcomes] + [("sdk", o) for o in sdk.outcomes]
    failed = [(c, o) for c, o in everything if not o.ok]
    by_cause: dict[str, int] = {}
    by_fault: dict[str, int] = {}
    for c, o in failed:
        by_cause[f"{c}: {o.error}"] = by_cause.get(f"{c}: {o.error}", 0) + 1
        by_fault[last_fault(o)] = by_fault.get(last_fault(o), 0) + 1
    ok_lat = [(o.end - o.start, during(o)) for _, o in everything if o.ok]
    per_kind: dict[str, list[float]] = {}
    for _, o in everything:
        for kind in kinds_during(o) if o.ok else ():
            per_kind.setdefault(kind, []).append(o.end - o.start)
    primary = [f for f in s.faults if f.target == "primary"]
    records = [o for _, o in everything]
    per_fault = fault_figures(records, [f.at for f in primary])
    bo = [f.first_token_ms / 1e3 for f in per_fault if f.first_token_ms is not None]
    kinds: dict[str, dict] = {}
    for f in s.faults:
        k = kinds.setdefault(f.kind, {"n": 0, "recovery_s": []})
        k["n"] += 1
        if f.recovered_s is not None:
            k["recovery_s"].append(f.recovered_s)
    for k in kinds.values():
        r = sorted(k.pop("recovery_s"))
        k["recovery_p50_s"] = round(percentile(r, 50), 2) if r else None
        k["recovery_max_s"] = round(r[-1], 2) if r else None

    def metric(name: str) -> float:
        return sum(v for k, v in m1.items() if k.split("{")[0] == name) - sum(
            v for k, v in m0.items() if k.split("{")[0] == name)

    def labelled(name: str) -> dict:
        return {k.split("{", 1)[1].rstrip("}"): v - m0.get(k, 0.0) for k, v in m1.items()
                if k.startswith(name + "{") and v - m0.get(k, 0.0)}

    streams = [o for _, o in everything if o.stream]
    return {
        "command": "python3 bench/chaos.py " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("chaos.py") else "",
        "seed": s.opts.seed, "duration_s": round(elapsed, 1), "fault_rate_per_min": s.opts.fault_rate,
        "concurrency": s.opts.concurrency, "loadavg": os.getloadavg(), "cores": os.cpu_count(),
        "requests": {
            "sent": len(everything) + quitters.attempts, "checked": len(everything),
            "raw_aiohttp": len(load.outcomes), "openai_sdk": len(sdk.outcomes),
            "streams": len(streams), "chat": sum(1 for _, o in everything if o.chat),
            "failed": len(failed), "failed_by_cause": by_cause, "failed_by_last_fault": by_fault,
            "broken_streams": sum(1 for _, o in failed if o.stream),
            "quitters": {"attempts": quitters.attempts, "left_after_events": dict(sorted(quitters.quit_after.items())),
                         "finished_before_leaving": quitters.completed, "errors_before_leaving": quitters.errors},
            "rps": round(len(everything) / elapsed, 1) if elapsed else 0.0,
        },
        "router": {"streams_migrated": metric("failover_router_migrations_total"),
                   "retries": metric("failover_router_retries_total"),
                   "failovers_by_reason": labelled("failover_router_failovers_total"),
                   "requests_by_code": labelled("failover_router_requests_total")},
        "latency": {"calm": _pct([t for t, d in ok_lat if not d]), "during_faults": _pct([t for t, d in ok_lat if d]),
                    "during_by_kind": {k: _pct(v) for k, v in sorted(per_kind.items())}},
        "blackout": {"per_primary_fault_ms": [round(b * 1e3, 1) for b in bo], **_pct(bo),
                     "max_ms": round(max(bo) * 1e3, 1) if bo else None,
                     "router_ms": [f.detail["router"]["blackout_ms"] if "router" in f.detail else None for f in primary],
                     "longest_stream_stall_ms": round(max((o.max_gap for o in streams), default=0.0) * 1e3, 1),
                     "client": summarize(per_fault),
                     "client_by_kind": {k: summarize(fault_figures(records, [f.at for f in primary if f.kind == k]))
                                        for k in sorted({f.kind for f in primary})}},
        "faults": {"injected": len(s.faults), "skipped": s.skipped, "by_kind": dict(sorted(kinds.items())),
                   "batch": "on" if use_batch else "off",
                   "problems": [f"{f.kind} t={f.at - s.t0:.1f}s: {p}" for f in s.faults for p in f.problems],
                   "list": [f.as_json(s.t0) for f in s.faults]},
        "daemon": {"baseline_bytes": s.baseline_bytes, "restarts_checked": sum(1 for c in s.daemon_checks
                                                                              if c["why"].startswith("after kill:daemon")),
                   "checks": s.daemon_checks},
        "quiesce": quiesce,
    }


def render(r: dict) -> str:
    q, rt, lat, bo, fa, sd = r["requests"], r["router"], r["latency"], r["blackout"], r["faults"], r["shutdown"]
    lines = [
        f"chaos soak: seed={r['seed']} duration={r['duration_s']}s fault_rate={r['fault_rate_per_min']}/min "
        f"concurrency={r['concurrency']} cores={r['cores']} loadavg={'/'.join(f'{x:.1f}' for x in r['loadavg'])} "
        f"startup={r['startup_s']}s",
        f"requests: sent={q['sent']} checked={q['checked']} (raw aiohttp {q['raw_aiohttp']}, openai sdk "
        f"{q['openai_sdk']}; streams {q['streams']}, chat {q['chat']}) rps={q['rps']}",
        f"failed={q['failed']} broken_streams={q['broken_streams']}",
    ]
    lines += [f"  failed: {n} x {cause}" for cause, n in sorted(q["failed_by_cause"].items())]
    lines += [f"  failed after: {n} x {k}" for k, n in sorted(q["failed_by_last_fault"].items())]
    qt = q["quitters"]
    lines.append(f"quitters (left on purpose, not failures): {qt['attempts']} attempts, left after events "
                 f"{qt['left_after_events']}, finished first {qt['finished_before_leaving']}, "
                 f"errors before leaving {qt['errors_before_leaving']}")
    lines.append(f"router: streams_migrated={rt['streams_migrated']:.0f} retries={rt['retries']:.0f} "
                 f"failovers={rt['failovers_by_reason']} codes={rt['requests_by_code']}")
    lines.append(f"latency calm: n={lat['calm']['n']} p50={lat['calm']['p50_ms']}ms p99={lat['calm']['p99_ms']}ms | "
                 f"during faults: n={lat['during_faults']['n']} p50={lat['during_faults']['p50_ms']}ms "
                 f"p99={lat['during_faults']['p99_ms']}ms")
    lines += [f"  during {k:16s} n={v['n']:4d} p50={v['p50_ms']}ms p99={v['p99_ms']}ms"
              for k, v in lat["during_by_kind"].items()]
    lines.append(f"blackout per primary fault: n={bo['n']} p50={bo['p50_ms']}ms p99={bo['p99_ms']}ms "
                 f"max={bo['max_ms']}ms longest_stream_stall={bo['longest_stream_stall_ms']}ms")
    lines.append(f"  all (client side, fault -> first token or answer): {bo['per_primary_fault_ms']}")
    lines.append("  " + client_line("primary faults", bo["client"]))
    lines += ["  " + client_line(kind, c) for kind, c in bo.get("client_by_kind", {}).items()]
    lines.append(f"  router's record (last good of old -> first good of new; None: no failover, the freeze "
                 f"ended before detection): {bo['router_ms']}")
    lines.append(f"faults: injected={fa['injected']} skipped={len(fa['skipped'])} batch={fa['batch']}")
    for kind, k in fa["by_kind"].items():
        lines.append(f"  {kind:16s} n={k['n']:3d} recovery p50={k['recovery_p50_s']}s max={k['recovery_max_s']}s")
    lines += [f"  PROBLEM: {p}" for p in fa["problems"]]
    lines += [f"  skipped: {x}" for x in fa["skipped"]]
    d = r["daemon"]
    bad = [c for c in d["checks"] if not c["ok"]]
    stray = max((c["idle_connections"] for c in d["checks"]), default=0)
    lines.append(f"daemon accounting: baseline={d['baseline_bytes']} bytes; {len(d['checks'])} checks "
                 f"({d['restarts_checked']} after daemon kills), {len(bad)} off baseline; most connections "
                 f"neither ours nor an engine's at a check: {stray}"
                 + "".join(f"\n  OFF: {c}" for c in bad))
    qu = r["quiesce"]
    lines.append(f"after the load: router inflight={qu['router_inflight']} queued={qu['router_queued']} "
                 f"engine running={qu['engine_running']} ok={qu['ok']}")
    lines.append(f"shutdown: exit={sd['exit_code']} in {sd['seconds']}s; leftover processes={len(sd['processes'])} "
                 f"run-dir files={sd['run_dir_files']} (dir exists: {sd['run_dir_exists']}) memfds={len(sd['memfds'])} "
                 f"arena mappings={len(sd['arena_mappings'])} (unrelated memfds on the machine: {sd['foreign_memfds']})")
    lines += [f"  LEFT: {p}" for p in sd["processes"] + sd["memfds"]]
    if r.get("batch"):
        b = r["batch"]
        lines.append(f"batch results: {b['done']} ids done, {b['duplicates']} duplicates, {b['errors']} errors")
    lines.append(f"clean={r['clean']} passed={r['passed']}")
    return "\n".join(lines)

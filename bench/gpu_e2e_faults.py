"""bench/gpu_e2e.py's failover part: ``--faults N`` kill -9s of the primary under load, on one node.

Each round waits until the node is whole (a ready primary, and the last round's victim relaunched
and ready as the standby), lets the load run ``settle`` s, then kill -9s the primary. The first
round also measures what only one kill shows well (the promoted standby's pool growth, throughput
before vs after, a per-second timeline). Then, from the clients' own records
(bench/client_figures.py), per fault and as p50/p99/max over all of them: fault -> first token to
any client, the worst in-flight client's wait for its next token, the longest stall inside a
stream, and the failed among the requests in flight; the router's own record printed beside it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import aiohttp

from client_figures import fault_figures, line, percentile, summarize
from loadgen import Load


def log_events(path: Path, event: str) -> list[dict]:
    found = []
    for text in path.read_text(errors="replace").splitlines():
        if f'"{event}"' in text:
            try:
                found.append(json.loads(text[text.index("{"):]))
            except ValueError:
                pass
    return found


def startup_steps(node_log: Path) -> str:
    """Where the last-started engine spent its start: seconds from 'listening' to each later step."""
    from datetime import datetime as dt

    lines = {e: log_events(node_log, e) for e in ("listening", "weights_loaded", "kv_cache_allocated", "engine_ready")}
    if not all(lines.values()):
        return "-"
    at = {e: dt.fromisoformat(v[-1]["timestamp"].replace("Z", "+00:00")) for e, v in lines.items()}
    return " ".join(f"{e}=+{(at[e] - at['listening']).total_seconds():.3f}s" for e in at if e != "listening")


async def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f} s")
        await asyncio.sleep(0.005)


def _whole(sup) -> bool:
    svc = sup.router.services["chat"]
    chat = [s for s in sup.slots.values() if s.service == "chat"]
    return (svc.routable() is not None and any(i.ready for i in svc.standbys())
            and all(s.state == "running" for s in chat))


async def failover_rounds(sup, report: dict, *, faults: int, warmup: float, settle: float,
                          concurrency: int = 16, png=None) -> None:
    load = Load(sup.router.url, max_tokens=32)
    async with aiohttp.ClientSession() as s:
        await load.learn_expected(s)
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(concurrency, stop))
    await asyncio.sleep(warmup)  # a big model's first waves of 16 take seconds each
    kills, routers, victims = [], [], []
    try:
        for i in range(faults):
            await _until(lambda: _whole(sup), 600, "whole node (ready primary and standby)")
            if i:
                await asyncio.sleep(settle)
            before = sup.router.promoter.last_failover.get("chat")
            victims.append(sup.router.services["chat"].routable().name)
            killed = await (first_kill(sup, report, load) if i == 0 else kill_primary(sup))
            kills.append(killed)
            if i:  # the previous victim came back (the node was whole): its replacement's ready time
                routers[-1]["relaunched"] = sup.slots[victims[-2]].ready_at
            await _until(lambda: sup.router.promoter.last_failover.get("chat") is not before, 60, "failover record")
            rec = sup.router.promoter.last_failover["chat"]
            routers.append(rec)
            print(f"  fault {i + 1:2d}: {rec['old']} -> {rec['new']} router's record: blackout={rec['blackout_ms']} ms "
                  f"detect={rec['detect_ms']} ms (the clients' figures follow the last fault) "
                  f"killed_unix={time.time() - (time.monotonic() - killed):.3f}", flush=True)
        await asyncio.sleep(max(settle, 2.0))
        if routers:
            ready = sup.slots[victims[-1]].ready_at
            routers[-1]["relaunched"] = ready if ready and ready > kills[-1] else None
    finally:
        stop.set()
        await runner
    figures = fault_figures(load.outcomes, kills)
    first = figures[0]
    report["crash_blackout_ms"] = None if first.first_token_ms is None else round(first.first_token_ms, 1)
    report["crash_worst_client_wait_ms"] = None if first.worst_wait_ms is None else round(first.worst_wait_ms, 1)
    report["crash_longest_stream_stall_ms"] = None if first.longest_stall_ms is None else round(first.longest_stall_ms, 1)
    report["crash_inflight_failed"] = f"{first.failed} of {first.inflight}"
    summary = summarize(figures)
    report["faults"] = len(kills)
    report["client_seen_over_faults"] = line("crash", summary)
    for key in ("first_token_ms", "worst_wait_ms", "longest_stall_ms"):
        for q in ("p50", "p99", "max"):
            report[f"crash_{key}_{q}"] = summary[key][q]
    blackout = [r["blackout_ms"] for r in routers]
    report["router_blackout_ms_p50_p99_max"] = (f"{percentile(blackout, 50)} / {percentile(blackout, 99)} / "
                                                f"{max(blackout)}" if blackout else "-")
    report["router_failover"] = json.dumps(routers[0] if routers else None, default=str)
    report["requests"] = len(load.outcomes)
    report["failed"] = sum(not o.ok for o in load.outcomes)
    report["broken_streams"] = sum(1 for o in load.outcomes if o.stream and not o.ok)
    report.update(_throughput(load, kills[0]) if kills else {})
    if png is not None and kills:  # --png: the clients' tokens around each kill, the router's steps marked
        import timeline_png

        report["timeline_png"] = timeline_png.write(png, load.outcomes, kills, timeline_png.marks_from_router(routers),
                                                    title="bench/gpu_e2e.py: kill -9 of the primary")


async def kill_primary(sup) -> float:
    slot = sup.slots[sup.router.services["chat"].routable().name]
    killed = time.monotonic()
    os.kill(slot.pid, signal.SIGKILL)
    return killed


async def first_kill(sup, report: dict, load: Load) -> float:
    """The first kill, with what one kill shows: the promoted standby's pool, the relaunch, and
    15.5 s of the load after it (for the throughput before vs after)."""
    slot = sup.slots[sup.router.services["chat"].routable().name]
    promoted = next(s for s in sup.slots.values() if s.service == "chat" and s is not slot)
    small = promoted.kv_bytes
    killed = await kill_primary(sup)
    full_at = None
    while not (slot.state == "running" and slot.ready_at and slot.ready_at > killed):
        if full_at is None and promoted.kv_bytes is not None and promoted.kv_bytes > (small or 0):
            full_at = time.monotonic()  # the promoted standby now holds its full pool
        await asyncio.sleep(0.005)
        if time.monotonic() - killed > 600:
            raise TimeoutError("no relaunch within 600 s")
    while full_at is None and time.monotonic() - killed < 60:
        if promoted.kv_bytes is not None and promoted.kv_bytes > (small or 0):
            full_at = time.monotonic()
        await asyncio.sleep(0.005)
    report["standby_kv_pool_gib"] = round((small or 0) / 2**30, 2)
    report["promoted_kv_pool_gib"] = round((promoted.kv_bytes or 0) / 2**30, 2)
    report["kill_to_full_pool_ms"] = None if full_at is None else round(1e3 * (full_at - killed), 1)
    report["replacement_kv_pool_gib"] = round((slot.kv_bytes or 0) / 2**30, 2)
    report["relaunch_to_ready_ms"] = round(1e3 * (slot.ready_at - killed), 1)
    report["relaunch_weights_source"] = slot.ready_info.get("weights_source")
    report["relaunch_engine_startup_s"] = slot.ready_info.get("startup_seconds")
    report["relaunch_engine_steps"] = startup_steps(sup.config.run_path.parent / "node.log")
    await asyncio.sleep(max(0.0, killed + 15.5 - time.monotonic()))
    return killed


def _throughput(load: Load, killed: float) -> dict:
    """The new primary's throughput 10 s after the first kill vs the old one's in the 5 s before."""
    def rate(lo: float, hi: float) -> float:
        return sum(1 for o in load.outcomes if o.ok and lo <= o.end < hi) / (hi - lo)
    before, after = rate(killed - 5.0, killed), rate(killed + 10.0, killed + 15.0)
    # requests completed and stream tokens received per second around the kill (second 0 = the kill)
    timeline = " ".join(
        f"{t}:{sum(1 for o in load.outcomes if o.ok and t <= o.end - killed < t + 1)}/"
        f"{sum(1 for o in load.outcomes for x in o.tokens if t <= x - killed < t + 1)}" for t in range(-12, 15))
    return {"timeline_s_done_tokens": timeline, "requests_per_s_before_kill": round(before, 2),
            "requests_per_s_10s_after": round(after, 2),
            "throughput_after_vs_before": round(after / before, 3) if before else None}

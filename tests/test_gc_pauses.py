"""failover_common/gc_pauses.py: the collector's pauses timed, exported and logged; what a process
built at start frozen out of the collector's reach; and both wired into the engine and the router."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from conftest import free_port
from engine_helpers import get, metric
from failover_common import gc_pauses
from failover_common.gc_pauses import GcPauses


class Cycle:
    def __init__(self) -> None:
        self.me = self


def garbage(n: int) -> None:
    """``n`` cycles, unreachable at once and freed only by a collection: the next one asked for
    (none starts on its own meanwhile)."""
    was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(n):
            Cycle()
    finally:
        if was:
            gc.enable()


def test_a_full_collection_is_counted_timed_and_reported_slow():
    seen = []
    pauses = GcPauses("t_", slow_s=0.0, notify=lambda: seen.append(len(pauses.slow))).install()
    try:
        gc.collect()
        garbage(5000)
        gc.collect(2)
    finally:
        pauses.remove()
    assert pauses.count[2] >= 2 and pauses.seconds[2] > 0 and pauses.longest[2] > 0
    slow = pauses.take_slow()
    assert [p["generation"] for p in slow][-1] == 2
    assert slow[-1]["collected"] >= 5000  # the cycles, each with its __dict__
    assert seen and pauses.take_slow() == []  # notified; taken once
    before = pauses.count[2]
    gc.collect(2)
    assert pauses.count[2] == before  # removed: no longer called


def test_the_figures_are_read_at_scrape_time():
    registry = CollectorRegistry()
    pauses = GcPauses("t_").install()
    registry.register(pauses)
    try:
        gc.collect(2)
        text = generate_latest(registry).decode()
    finally:
        pauses.remove()
    assert 't_gc_collections_total{generation="2"} ' in text
    line = next(ln for ln in text.splitlines() if ln.startswith('t_gc_collections_total{generation="2"}'))
    assert float(line.rsplit(" ", 1)[1]) == pauses.count[2] >= 1
    assert 't_gc_pause_max_seconds{generation="2"}' in text and "t_gc_frozen_objects " in text


def test_freeze_takes_what_exists_out_of_the_collectors_walk():
    kept = [Cycle() for _ in range(1000)]
    assert any(o is kept[0] for o in gc.get_objects())
    try:
        frozen = gc_pauses.freeze()
        assert frozen == gc.get_freeze_count() >= 1000
        assert not any(o is kept[0] for o in gc.get_objects())  # no generation holds it: never walked
        made_after = Cycle()
        assert any(o is made_after for o in gc.get_objects())  # what comes later is collected as before
    finally:
        gc.unfreeze()  # the test process's heap as it was
    assert any(o is kept[0] for o in gc.get_objects())


@pytest.mark.asyncio
async def test_watch_logs_each_slow_pause_on_the_loop():
    lines = []

    class Log:
        def warning(self, event, **kw):
            lines.append((event, kw))

    registry = CollectorRegistry()
    pauses = gc_pauses.watch(registry, "t_", asyncio.get_running_loop(), Log(), slow_s=0.0)
    try:
        garbage(2000)
        gc.collect(2)
        assert lines == []  # not from inside the collection: on the loop's next turn
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    finally:
        pauses.remove()
    assert ("gc_pause", {"generation": 2, "ms": lines[-1][1]["ms"], "collected": lines[-1][1]["collected"]}) == lines[-1]
    assert lines[-1][1]["collected"] >= 2000


def test_an_engine_freezes_its_start_and_exports_its_pauses(procs, tiny_model):
    from engine_helpers import start_engine

    port = free_port()
    start_engine(procs, tiny_model, port, "--weights", "disk")
    status, ready = get(port, "/ready")
    assert status == 200 and ready["gc_frozen_objects"] > 20_000  # torch, the model, the tokenizer
    # frozen objects freed by their refcounts since (a module's temporaries) leave the count
    assert 0.9 * ready["gc_frozen_objects"] < metric(port, "failover_engine_gc_frozen_objects") <= ready["gc_frozen_objects"]
    _, text = get(port, "/metrics")
    for g in "012":
        assert f'failover_engine_gc_collections_total{{generation="{g}"}}' in text


def test_a_standalone_router_freezes_its_start_and_exports_its_pauses(procs, tmp_path):
    port = free_port()
    log = open(tmp_path / "router.log", "w")
    proc = procs.python("-m", "failover", "router", "--backend", f"a=http://127.0.0.1:{free_port()}",
                        "--port", str(port), "--log-level", "warning", stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline and "failover_router_gc_frozen_objects" not in text:
        assert proc.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            time.sleep(0.1)
    frozen = next(float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("failover_router_gc_frozen_objects "))
    assert frozen > 10_000  # aiohttp, structlog, prometheus_client, the router's modules
    assert 'failover_router_gc_collections_total{generation="2"}' in text


def test_the_environment_can_turn_freezing_off(monkeypatch):
    monkeypatch.setenv("FAILOVER_GC_FREEZE", "0")
    before = gc.get_freeze_count()
    assert gc_pauses.freeze() == 0
    assert gc.get_freeze_count() == before == 0

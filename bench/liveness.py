"""How soon the supervisor notices a frozen cache daemon or zygote, and a daemon that lost its model.

    python3 bench/liveness.py --rounds 20                        # CPU, tiny model, the config's defaults
    python3 bench/liveness.py --rounds 5 --ping-interval 0.25 --ping-timeout 1.0

One node (the Supervisor of ``failover up``, in this process: cache daemon, zygote, primary + standby,
router) under light closed-loop load (bench/loadgen.py). Each round SIGSTOPs the daemon (then the
zygote), and measures from the SIGSTOP: the watchdog's verdict (``daemon_hung`` / ``zygote_hung``:
noticed) and a new process ready again (replaced). Then ``--evicts`` forced evicts of the node's model
by another client: from the evict to the supervisor's ``daemon_model_lost`` incident (noticed) and to
the model resident again (reloaded). p50/p99/max over the rounds; the load's failed and broken counts
beside (a frozen helper must cost clients nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client_figures import percentile, requests_summary  # noqa: E402
from loadgen import Load  # noqa: E402


async def _until(predicate, timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f} s")
        await asyncio.sleep(0.002)
    return time.monotonic()


def _whole(sup) -> bool:
    svc = sup.router.services["chat"]
    return (sup.daemon.ready and sup.zygote.ready and svc.routable() is not None
            and any(i.ready for i in svc.standbys()) and all(s.state == "running" for s in sup.slots.values()))


async def freeze_round(sup, helper: str) -> tuple[float, float]:
    """SIGSTOP ``helper``; seconds to the watchdog's verdict and to a new ready one."""
    dog = next(d for d in sup.watchdogs if d.event == f"{helper}_hung")
    child = sup.daemon.child if helper == "daemon" else sup.zygote.child
    hangs = dog.hangs
    t0 = time.monotonic()
    os.kill(child.pid, signal.SIGSTOP)
    noticed = await _until(lambda: dog.hangs > hangs, 60, f"{helper}_hung")
    if helper == "daemon":
        ready = await _until(lambda: sup.daemon.ready and sup.daemon.child is not child, 120, "a new daemon")
    else:
        ready = await _until(lambda: sup.zygote.ready and sup.zygote.child is not child, 120, "a new zygote")
    return noticed - t0, ready - t0


async def evict_round(sup) -> tuple[float, float]:
    """A forced evict of the node's model by another client; seconds to the incident, and to the
    model resident again."""
    import msgspec

    from cache_daemon.client import evict, status
    from cache_daemon.fingerprint import CacheConfig

    sock = sup.config.daemon_socket
    keys = sup.daemon.model_keys
    incidents = len(sup.daemon.incidents)
    configs = [msgspec.convert(fp, CacheConfig) for fp in sup.daemon.ready_info["fingerprints"]]
    t0 = time.monotonic()
    for cfg in configs:
        await asyncio.to_thread(evict, sock, cfg, force=True)
    noticed = await _until(lambda: len(sup.daemon.incidents) > incidents, 60, "daemon_model_lost")
    await _until(lambda: sup.daemon.ready, 120, "the daemon ready again")
    st = await asyncio.to_thread(status, sock, timeout=5.0)
    assert keys <= {m.key for m in st.models}, "the reloaded daemon does not hold the model"
    return noticed - t0, time.monotonic() - t0


def _fmt(name: str, values: list[float]) -> str:
    ms = [v * 1e3 for v in values]
    if not ms:
        return f"{name}: -"
    return (f"{name}: n={len(ms)} p50={percentile(ms, 50):.0f} p99={percentile(ms, 99):.0f} "
            f"max={max(ms):.0f} ms")


async def run(a: argparse.Namespace, work: Path) -> None:
    from failover.config.schema import parse_config
    from failover.cmd.demo import node_config
    from failover.node.supervisor import Supervisor
    from failover.tools.tiny_model import TinySpec, write_checkpoint

    model = write_checkpoint(work / "model", TinySpec())
    raw = node_config(work, model, "zygote")
    raw["supervisor"] |= {k: v for k, v in (("ping_interval", a.ping_interval), ("ping_timeout", a.ping_timeout))
                          if v is not None}
    config = parse_config(raw, source="bench-liveness")
    print(f"# ping_interval={config.supervisor.ping_interval}s ping_timeout={config.supervisor.ping_timeout}s "
          f"rounds={a.rounds} evicts={a.evicts}", flush=True)
    with open(work / "node.log", "wb") as out:
        sup = Supervisor(config, child_output=out)
        try:
            await sup.start()
            load = Load(config.router_url, max_tokens=8)
            import aiohttp

            async with aiohttp.ClientSession() as s:
                await load.learn_expected(s)
            stop = asyncio.Event()
            runner = asyncio.create_task(load.run(2, stop))
            results: dict[str, list[tuple[float, float]]] = {"daemon": [], "zygote": [], "evict": []}
            for i in range(a.rounds):
                for helper in ("daemon", "zygote"):
                    await _until(lambda: _whole(sup), 120, "a whole node")
                    await asyncio.sleep(a.settle)
                    results[helper].append(await freeze_round(sup, helper))
                    print(f"  round {i + 1:2d} {helper}: noticed {results[helper][-1][0] * 1e3:.0f} ms, "
                          f"replaced and ready {results[helper][-1][1] * 1e3:.0f} ms after the SIGSTOP", flush=True)
            for i in range(a.evicts):
                await _until(lambda: _whole(sup), 120, "a whole node")
                await asyncio.sleep(a.settle)
                results["evict"].append(await evict_round(sup))
                print(f"  evict {i + 1:2d}: noticed {results['evict'][-1][0] * 1e3:.0f} ms, model resident "
                      f"again {results['evict'][-1][1] * 1e3:.0f} ms after the evict", flush=True)
            stop.set()
            await runner
        finally:
            await sup.stop()
    for helper, what in (("daemon", "SIGSTOP of the cache daemon"), ("zygote", "SIGSTOP of the zygote"),
                         ("evict", "forced evict of the node's model")):
        r = results[helper]
        print(f"{helper}: {what}: " + _fmt("noticed", [x for x, _ in r]) + "; "
              + _fmt("replaced/reloaded and ready", [y for _, y in r]))
    summary = requests_summary(load.outcomes)
    print(f"clients: requests={summary['requests']} failed={summary['failed']} "
          f"broken_streams={summary['broken_streams']} longest stall inside a stream="
          f"{summary['longest_stream_stall_ms']} ms")
    if a.json:
        a.json.write_text(json.dumps({k: v for k, v in results.items()} | {"clients": summary}, indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="freezes of the daemon and of the zygote, each")
    p.add_argument("--evicts", type=int, default=5, help="forced evicts of the node's model")
    p.add_argument("--settle", type=float, default=0.5, help="seconds between a whole node and the next fault")
    p.add_argument("--ping-interval", type=float, default=None, help="default: the config's")
    p.add_argument("--ping-timeout", type=float, default=None, help="default: the config's")
    p.add_argument("--json", type=Path, help="write the per-round figures here too")
    a = p.parse_args()
    from failover_common.logs import configure_logging

    configure_logging("error", process="bench-liveness")
    print(f"# bench/liveness.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}  "
          f"cores={os.cpu_count()}  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fo-live-", dir="/tmp") as tmp:
        asyncio.run(run(a, Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

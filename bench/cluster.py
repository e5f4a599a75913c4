"""Beyond one node: node loss, router loss and a frozen node, as streaming clients see them.

    flock /tmp/heavy.lock python3 bench/cluster.py [--rounds 10] [--ttl 2]

The set-up of tests/test_cluster_nodes.py: a real 3-member etcd cluster on loopback, two nodes
(`failover up` on 127.0.0.2 and 127.0.0.3, one engine each), two peer routers (`failover router
--etcd`) behind one HAProxy TCP front with /ready checks every 100 ms, and openai SDK clients
streaming greedy completions through the front, each checked against the undisturbed run.

Per round, measured client-side from the fault (monotonic clock of this process):
- node: kill -9 of the primary's whole node (supervisor, daemon, zygote, engine). Longest stall
  inside any stream spanning the kill, first chunk to any client after it; then the node restarts.
- router: kill -9 of one router. Longest stall inside a stream; streams cut (those running through
  the dead router: a TCP front cannot move them; an HTTP front, ``--front http``, re-sends those
  that had no response byte yet) and new requests failed, counted apart.
- frozen: SIGSTOP of the primary's node. Time until etcd names another primary (the routers'
  probes), until the node's lease is gone (the TTL), client stall; after SIGCONT the node must never
  be primary again (its router follows etcd).
Split brain: each fault must change the primary key exactly once (its version), and after each
round every router routes to the instance etcd names.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from cluster_helpers import KEY, Rig, etcd_get, signal_all  # noqa: E402
from etcd_helpers import ETCD, HAPROXY, version  # noqa: E402
from supervisor_helpers import wait_until  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def fmt(xs: list[float], unit: str = "ms", scale: float = 1e3) -> str:
    return f"p50 {pct(xs, 50) * scale:,.0f} / p99 {pct(xs, 99) * scale:,.0f} / max {max(xs) * scale:,.0f} {unit}" \
        if xs else "-"


def first_after(arrivals: list[float], t: float) -> float | None:
    later = [a for a in arrivals if a > t]
    return min(later) - t if later else None


def one_primary(rig: Rig) -> bool:
    want = rig.primary()
    return all(r.primary() == want for r in rig.routers)


def node_round(rig: Rig, out: dict) -> None:
    node, before, v0 = rig.node_of_primary(), rig.primary(), etcd_get(rig.etcd.endpoints, KEY)["version"]
    s = rig.streaming()
    t = time.monotonic()
    node.kill()
    wait_until(lambda: rig.primary() != before, 30, "a promotion")
    time.sleep(1.0)
    s.stop()
    out["stall"].append(s.longest_gap_after(t, within=1.0))
    out["first"].append(first_after(s.arrivals, t) or float("nan"))
    out["failed"] += len(s.failures)
    out["mismatch"] += len(s.mismatches)
    out["requests"] += s.ok + len(s.failures)
    out["errors"] += s.failures[:2]
    out["split"] += etcd_get(rig.etcd.endpoints, KEY)["version"] - v0 != 1
    node.start()
    rig.settle()
    out["split"] += not one_primary(rig)


def router_round(rig: Rig, out: dict, i: int) -> None:
    victim = rig.routers[i % len(rig.routers)]
    s = rig.streaming(max_retries=2)  # the SDK's default: see the router line of the report
    t = time.monotonic()
    victim.kill()
    time.sleep(2.0)
    s.stop()
    out["stall"].append(s.longest_gap_after(t, within=1.0))
    out["cut"] += sum(1 for f in s.failed_at if f[0] <= t)
    out["failed"] += sum(1 for f in s.failed_at if f[0] > t)
    out["mismatch"] += len(s.mismatches)
    out["requests"] += s.ok + len(s.failures)
    out["errors"] += s.failures[:2]
    victim.start()
    rig.settle()
    out["split"] += not one_primary(rig)


def frozen_round(rig: Rig, out: dict, ttl: int) -> None:
    node, before, v0 = rig.node_of_primary(), rig.primary(), etcd_get(rig.etcd.endpoints, KEY)["version"]
    s = rig.streaming()
    t = time.monotonic()
    pids = node.freeze()
    try:
        wait_until(lambda: rig.primary() != before, 30, "a promotion away from the frozen node")
        out["promoted"].append(time.monotonic() - t)
        wait_until(lambda: etcd_get(rig.etcd.endpoints, f"/failover/test/nodes/{node.name}") is None, 30,
                   "the lease to expire")
        out["lease_gone"].append(time.monotonic() - t)
        s.stop()
    finally:
        signal_all(pids, signal.SIGCONT)
    out["stall"].append(s.longest_gap_after(t, within=1.0))
    out["failed"] += len(s.failures)
    out["mismatch"] += len(s.mismatches)
    out["requests"] += s.ok + len(s.failures)
    out["split"] += etcd_get(rig.etcd.endpoints, KEY)["version"] - v0 != 1
    t_cont = time.monotonic()
    while time.monotonic() - t_cont < 3.0:  # the thawed node must not serve as primary
        if any(r.primary() == before for r in rig.routers):
            out["split"] += 1
            break
        time.sleep(0.05)
    rig.settle()
    out["split"] += not one_primary(rig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--ttl", type=int, default=2, help="lease TTL of nodes and routers (s)")
    p.add_argument("--front", choices=("tcp", "http"), default="tcp",
                   help="HAProxy mode in front of the routers (tests/etcd_helpers.py says what each can do)")
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: a generated tiny one)")
    a = p.parse_args()
    if ETCD is None or HAPROXY is None:
        print("bench/cluster.py needs etcd-server and haproxy (apt-get install etcd-server haproxy)")
        return 2
    print(f"date {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; machine {platform.node()} "
          f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"{version(ETCD, '--version')}; {version(HAPROXY, '-v')}")
    model, scratch = a.model, None
    if model is None:
        from failover.tools.tiny_model import TinySpec, write_checkpoint

        scratch = Path(tempfile.mkdtemp(prefix="fo-bench-cluster-"))
        model = write_checkpoint(scratch, TinySpec(shards=1))
    try:
        rig = Rig(model, ttl=a.ttl, front=a.front)
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    node = {"stall": [], "first": [], "failed": 0, "mismatch": 0, "requests": 0, "split": 0, "errors": []}
    router = {"stall": [], "cut": 0, "failed": 0, "mismatch": 0, "requests": 0, "split": 0, "errors": []}
    frozen = {"promoted": [], "lease_gone": [], "stall": [], "failed": 0, "mismatch": 0, "requests": 0, "split": 0}
    try:
        for i in range(a.rounds):
            node_round(rig, node)
            router_round(rig, router, i)
            frozen_round(rig, frozen, a.ttl)
            print(f"round {i + 1}/{a.rounds}: node stall {node['stall'][-1] * 1e3:.0f} ms, router stall "
                  f"{router['stall'][-1] * 1e3:.0f} ms, frozen -> promoted {frozen['promoted'][-1] * 1e3:.0f} ms, "
                  f"lease gone {frozen['lease_gone'][-1] * 1e3:.0f} ms", flush=True)
    finally:
        rig.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    inter = rig.front.inter_ms
    print(f"\n{a.rounds} rounds each, TTL {a.ttl} s, HAProxy {a.front} mode, check every {inter} ms, "
          "client = openai SDK streams")
    print(f"node kill -9   : longest stall {fmt(node['stall'])}; first chunk after the kill "
          f"{fmt([x for x in node['first'] if x == x])}; {node['failed']} failed / {node['requests']} requests, "
          f"{node['mismatch']} streams differing from the greedy run; split brain {node['split']}")
    print("router kill -9 : (clients with the SDK's default max_retries=2; the other rows: 0, every error counts)")
    print(f"router kill -9 : longest stall {fmt(router['stall'])}; {router['failed']} new requests failed, "
          f"{router['cut']} streams cut (running through the dead router) / {router['requests']}; "
          f"{router['mismatch']} differing; split brain {router['split']}")
    print(f"frozen node    : promoted elsewhere after {fmt(frozen['promoted'])}; lease gone after "
          f"{fmt(frozen['lease_gone'])} (TTL {a.ttl * 1e3:.0f} ms); longest stall {fmt(frozen['stall'])}; "
          f"{frozen['failed']} failed / {frozen['requests']}; split brain {frozen['split']}")
    target_node = pct(node["stall"], 99) <= 1.0 and node["failed"] == 0
    target_router = router["failed"] + router["cut"] == 0 and pct(router["stall"], 99) <= inter / 1e3 + 0.1
    print(f"targets: node loss p99 <= 1 s and 0 failed: {'met' if target_node else 'NOT met'}; router loss "
          f"0 failed and stall <= {inter + 100} ms: {'met' if target_router else 'NOT met'}; no split brain: "
          f"{'met' if node['split'] + router['split'] + frozen['split'] == 0 else 'NOT met'}")
    for name, figures in (("node", node), ("router", router)):
        for err in figures["errors"][:4]:
            print(f"  {name} error seen: {err[:200]}")
    if node["stall"]:
        print(f"node stall mean {statistics.fmean(node['stall']) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

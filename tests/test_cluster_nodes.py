"""Two nodes, two peer routers behind HAProxy, a real 3-member etcd cluster: the faults of issue 17.

Node a listens on 127.0.0.2 and node b on 127.0.0.3, each its own `failover up` (run dir, ports,
daemon, zygote, one engine). Routers r1 and r2 (`failover router --etcd`) sit behind one HAProxy TCP
front that checks their /ready every 100 ms. Clients are the openai SDK, streaming greedy
completions through the front; each stream is compared with the undisturbed greedy run.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from cluster_helpers import KEY, Rig, Streams, etcd_get, signal_all
from etcd_helpers import ETCD, HAPROXY
from supervisor_helpers import wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(ETCD is None or HAPROXY is None, reason="needs etcd-server and haproxy")]


@pytest.fixture(scope="module")
def rig(tiny_model):
    r = Rig(tiny_model, standbys_b=1)
    yield r
    r.close()


def log_rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def what_went_on(rig, last: int = 12) -> str:
    """For a failure's message: the front's last lines and each router's last warnings."""
    parts = ["haproxy:\n" + "\n".join(rig.front.log().splitlines()[-last:])]
    for r in rig.routers:
        rows = [row for row in log_rows(r.log()) if row.get("level") in ("warning", "error")]
        parts.append(f"{r.name}:\n" + "\n".join(json.dumps(row) for row in rows[-last:]))
    return "\n".join(parts)


def assert_clean(streams: Streams, rig) -> None:
    assert not streams.failures, (len(streams.failures), streams.failures[:3], what_went_on(rig))
    assert not streams.mismatches, streams.mismatches[:5]
    assert streams.ok > 0


def test_kill_9_of_the_primary_engine_fails_over_to_the_other_node(rig):
    node = rig.node_of_primary()
    before, rev = rig.primary(), rig.version()
    old_pids = node.engine_pids()
    s = rig.streaming()
    signal_all(old_pids, signal.SIGKILL)
    wait_until(lambda: rig.primary() != before, 20, "a promotion")
    rig.settle()  # the killed engine is relaunched on its own node and rejoins as the standby
    s.stop()
    assert_clean(s, rig)
    assert rig.primary().endswith("@" + rig.other(node).name)
    assert etcd_get(rig.etcd.endpoints, KEY)["mod_revision"] > rev
    assert set(node.engine_pids()).isdisjoint(old_pids), "the standby is not a fresh process"
    promotions = [p for r in rig.routers for p in r.status()["cluster"]["promotions"] if p["previous"] == before]
    assert len(promotions) == 1, promotions  # two routers saw the failure; one promoted
    # the peer routers leave the dead engine to its node (which relaunched it, above): an info
    # line each, not a warning to stop it by hand
    fences = [row for r in rig.routers for row in log_rows(r.log()) if row.get("action") == "fence"]
    assert fences and {(row["event"], row["level"], row["instance"]) for row in fences} == {
        ("left_to_node", "info", before)}, fences


def test_failover_status_shows_nodes_instances_roles_and_routers(rig):
    import subprocess
    import sys

    r = rig.routers[1]
    out = subprocess.run([sys.executable, "-m", "failover", "status", "--url", r.url, "--token-file",
                          str(r.token_path)], capture_output=True, text=True, timeout=30, check=True).stdout
    primary = rig.primary()
    for needle in ("NODE", "LEASE AGE", "127.0.0.2", "127.0.0.3", "chat-0@a", "chat-0@b", "r1", "r2",
                   f"chat: {primary}"):
        assert needle in out, f"{needle!r} missing from:\n{out}"
    row = next(line for line in out.splitlines() if line.startswith("chat") and primary in line and "http" in line)
    assert " primary " in row, row
    for router in rig.routers:  # each router's row names its process
        line = next(line for line in out.splitlines() if line.split()[:1] == [router.name])
        assert line.split()[1] == str(router.proc.pid), line
    node_out = subprocess.run([sys.executable, "-m", "failover", "status", "--config",
                               str(rig.nodes["a"].config_path)], capture_output=True, text=True, timeout=30,
                              check=True).stdout
    assert "node-a" in node_out and "chat-0@b" in node_out, node_out


def test_kill_9_of_one_router_the_front_carries_on(rig):
    victim = rig.routers[0]
    # The SDK's default retries: a keep-alive connection the front had pinned to the dead router
    # fails on its next request, which the SDK re-sends (it never re-sends a stream under way).
    s = rig.streaming(max_retries=2)
    t_kill = time.monotonic()
    victim.kill()
    time.sleep(2.0)
    s.stop()
    # A TCP front cannot move a stream that was running through the dead router: those break.
    # A request started after the kill is redispatched by the front (connect refused), never lost.
    late = [f for f in s.failed_at if f[0] > t_kill]
    assert not late, (late, s.failures)
    assert not s.mismatches and s.ok > 0
    assert len(s.failures) <= s.workers, f"more failures than streams in flight at the kill: {s.failures}"
    assert s.longest_gap_after(t_kill) < 5.0
    victim.start()
    rig.settle()


def admin(router, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "failover", *args, "--url", router.url, "--token-file",
                          str(router.token_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr + out.stdout
    return out.stdout


def claims_after(rig, previous: str) -> list[dict]:
    """Every won claim that replaced ``previous``, by the peer routers and the nodes' own."""
    docs = [r.status()["cluster"] for r in rig.routers]
    docs += [n.status()["cluster"] for n in rig.nodes.values() if n.proc.poll() is None]
    return [p for d in docs for p in d["promotions"] if p["previous"] == previous]


def test_kill_9_of_the_whole_primary_node_promotes_the_other_nodes_standby_then_it_rejoins(rig):
    b = rig.nodes["b"]
    if rig.node_of_primary() is not b:  # b has a standby beside its primary: the case to decide
        admin(rig.routers[0], "promote", "chat", "--to", "chat-0@b")
        rig.settle()
    before = rig.primary()
    s = rig.streaming()
    b.kill()  # b's standby dies too, but the routers still count it ready until its probes fail
    wait_until(lambda: rig.primary() != before, 20, "a promotion")
    time.sleep(1.0)
    s.stop()
    assert_clean(s, rig)
    won = claims_after(rig, before)
    assert len(won) == 1 and won[0]["instance"] == "chat-0@a", won  # never b's own standby
    assert rig.primary() == "chat-0@a"
    b.start()
    rig.settle()
    assert rig.node_of_primary() is not b, "the restarted node took the primary back"


def test_drain_of_the_cluster_primary_switches_over_by_cas_then_drains_failing_nothing(rig):
    before, version = rig.primary(), etcd_get(rig.etcd.endpoints, KEY)["version"]
    node = rig.node_of_primary()
    slot = before.rpartition("@")[0]
    old_pid = next(x["pid"] for x in node.status()["supervisor"]["slots"] if x["slot"] == slot)
    migrated = sum(rig.metric(r, "failover_router_migrations_total") for r in rig.routers)
    s = rig.streaming()
    out = admin(rig.routers[0], "drain", before)
    assert "drained=True" in out, out  # r1's in-flight requests on it finished there
    key = etcd_get(rig.etcd.endpoints, KEY)
    assert key["version"] == version + 1 and key["value"]["previous"] == before, key
    assert key["value"]["reason"] == "drain" and key["value"]["by"] == "r1"
    rig.settle()  # every router on the new primary; the drained one back as a fresh standby
    s.stop()
    assert_clean(s, rig)
    assert rig.primary() != before and etcd_get(rig.etcd.endpoints, KEY)["version"] == version + 1
    new_pid = next(x["pid"] for x in node.status()["supervisor"]["slots"] if x["slot"] == slot)
    assert new_pid != old_pid, "the drained engine was not recycled"
    # handed over, not fenced: no stream was cut and re-issued elsewhere
    assert sum(rig.metric(r, "failover_router_migrations_total") for r in rig.routers) == migrated


def test_sigstop_of_a_whole_node_past_the_ttl_is_fenced_and_never_primary_again(rig):
    node = rig.node_of_primary()
    before = rig.primary()
    slot = before.rpartition("@")[0]
    old_engine = next(x["pid"] for x in node.status()["supervisor"]["slots"] if x["slot"] == slot)
    s = rig.streaming()
    pids = node.freeze()
    try:
        wait_until(lambda: rig.primary() != before, 20, "a promotion away from the frozen node")
        wait_until(lambda: etcd_get(rig.etcd.endpoints, f"/failover/test/nodes/{node.name}") is None, 20,
                   "the frozen node's lease to expire")
        time.sleep(0.5)
        s.stop()
        assert_clean(s, rig)
    finally:
        signal_all(pids, signal.SIGCONT)
    # Back: it learns that its instance lost the primary key, fences it, registers again under a
    # new lease and its instance comes back as the standby. The peer routers never route to it.
    t_cont = time.monotonic()
    seen_primary_at = []
    while True:
        doc = node.status()
        mine = [i for svc in doc["services"] for i in svc["instances"]]
        if any(i["role"] == "primary" for i in mine):
            seen_primary_at.append(time.monotonic() - t_cont)
        for r in rig.routers:
            assert r.primary() != before, f"{r.name} routes to the fenced instance again"
        if doc["supervisor"]["cluster"]["registrations"] >= 2 and mine and all(
                i["role"] == "standby" for i in mine if i["name"] == slot):
            break
        assert time.monotonic() - t_cont < 60, doc
        time.sleep(0.05)
    # its own router may still hold the old role until it reads etcd's events (the first poll)
    assert all(t < 0.5 for t in seen_primary_at), seen_primary_at
    # the fenced primary's engine is a new process (a standby beside it, on node b, is not fenced)
    assert old_engine not in node.engine_pids(), "the fenced engine was not stopped"
    assert rig.primary() != before
    rig.settle()


def test_sigstop_of_the_etcd_member_in_use_moves_everyone_off_it_and_a_promotion_still_works(rig):
    # the member that router r1 asks first (every client starts on the same one unless it moved)
    frozen = rig.etcd.index(rig.routers[0].status()["cluster"]["etcd"][0])
    registrations = {n.name: n.status()["supervisor"]["cluster"]["registrations"] for n in rig.nodes.values()}
    s = rig.streaming()
    rig.etcd.freeze(frozen)
    try:
        time.sleep(3.0)  # past the TTL (2 s): leases kept alive through the other members
        for n in rig.nodes.values():
            assert etcd_get(rig.etcd.endpoints[frozen + 1:] + rig.etcd.endpoints[:frozen],
                            f"/failover/test/nodes/{n.name}") is not None, f"node {n.name}'s lease expired"
        node = rig.node_of_primary()
        before = rig.primary()
        signal_all(node.engine_pids(), signal.SIGKILL)  # a promotion while the member is frozen
        wait_until(lambda: rig.primary() != before, 20, "a promotion with one member frozen")
        rig.settle()  # both routers follow, the killed engine is back as the standby
        s.stop()
        assert_clean(s, rig)
        for r in rig.routers:
            doc = r.status()["cluster"]
            assert not doc["held"] and doc["etcd"][0] != rig.etcd.endpoints[frozen], doc["etcd"]
        for n in rig.nodes.values():
            doc = n.status()["supervisor"]["cluster"]
            assert doc["registrations"] == registrations[n.name], "a node lost its lease to a frozen member"
            assert doc["etcd"][0] != rig.etcd.endpoints[frozen]
    finally:
        rig.etcd.thaw(frozen)
        rig.etcd.wait_healthy(members=[frozen])


def test_kill_9_of_one_etcd_member_then_a_failover_still_goes_through(rig):
    rig.etcd.kill(0)
    try:
        node = rig.node_of_primary()
        before = rig.primary()
        s = rig.streaming()
        signal_all(node.engine_pids(), signal.SIGKILL)
        wait_until(lambda: rig.primary() != before, 20, "a promotion with 2 of 3 members")
        rig.settle()
        s.stop()
        assert_clean(s, rig)
    finally:
        rig.etcd.restart(0)
        rig.etcd.wait_healthy(members=[0])

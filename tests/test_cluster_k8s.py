"""The Kubernetes Lease backend wired into running processes: a node (`failover up` with
`[cluster] backend = "k8s"`) and two peer routers (`failover router --k8s-lease NAMESPACE`), with
no etcd at all.

No Kubernetes API server runs here: the store is tests/k8s_standin.py, a separate process that
follows the documented Lease semantics (409 on a stale resourceVersion or an existing name, one
resourceVersion counter, LIST by label, DELETE, a bearer token). What this shows is the backend's
whole path through real processes; not a real API server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from cluster_helpers import ClusterNode, PeerRouter, Streams, expected_texts
from conftest import Procs
from failover_common.ports import free_port
from supervisor_helpers import http, wait_until

LEASES = "/apis/coordination.k8s.io/v1/namespaces/failover/leases"
PRIMARY = "failover-test-primary-chat"


class Api:
    def __init__(self, procs: Procs, base) -> None:
        self.port = free_port()
        self.token_file = base / "k8s.token"
        self.token_file.write_text("sekrit\n")
        os.chmod(self.token_file, 0o600)
        here = os.path.dirname(__file__)
        self.proc = procs.python(os.path.join(here, "k8s_standin.py"), str(self.port), str(self.token_file))
        wait_until(self._up, 20, "the Kubernetes stand-in")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _up(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def get(self, name: str) -> dict | None:
        code, doc = http("GET", f"{self.url}{LEASES}/{name}", token="sekrit", timeout=5)
        return doc if code == 200 else None

    def names(self) -> list[str]:
        code, doc = http("GET", f"{self.url}{LEASES}", token="sekrit", timeout=5)
        assert code == 200, doc
        return [i["metadata"]["name"] for i in doc["items"]]


@pytest.fixture(scope="module")
def k8s(tiny_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("k8s")
    procs = Procs()
    try:
        api = Api(procs, base)
        store = {"backend": "k8s", "namespace": "failover", "api": api.url, "token_file": str(api.token_file)}
        node = ClusterNode(procs, tiny_model, base, "a", "127.0.0.2", [], standbys=1, cluster=store).start()
        node.wait_serving()
        args = ["--k8s-lease", "failover", "--k8s-api", api.url, "--k8s-token-file", str(api.token_file)]
        routers = [PeerRouter(procs, base, f"r{i}", [], store=args).start() for i in (1, 2)]
        yield api, node, routers
    finally:
        procs.stop_all()


def holder(api: Api) -> tuple[str | None, int]:
    lease = api.get(PRIMARY)
    if lease is None:
        return None, 0
    return lease["spec"]["holderIdentity"], int(lease["metadata"]["resourceVersion"])


def test_routers_on_kubernetes_leases_fail_over_with_one_cas_and_follow(k8s):
    api, node, routers = k8s
    wait_until(lambda: holder(api)[0] is not None and all(r.primary() == holder(api)[0] for r in routers), 60,
               "both routers on the primary the Lease names")
    first, rv = holder(api)
    record = json.loads(api.get(PRIMARY)["metadata"]["annotations"]["failover.io/record"])
    assert record["instance"] == first and record["by"] in ("r1", "r2", "node-a")
    # the node's records are Leases under its heartbeat Lease
    names = api.names()
    assert "failover-test-nodes-a" in names and "failover-test-instances-chat-chat-0-a" in names, names
    expected = expected_texts(routers[0].url)
    streams = Streams(routers[0].url, expected)
    streams.start()
    wait_until(lambda: streams.ok > 0, 30, "a stream")
    pid = next(s["pid"] for s in node.status()["supervisor"]["slots"] if f"{s['slot']}@a" == first)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: holder(api)[0] not in (None, first), 20, "a promotion through the Lease")
    second, rv2 = holder(api)
    wait_until(lambda: all(r.primary() == second for r in routers), 20, "both routers follow")
    time.sleep(0.5)
    streams.stop()
    assert not streams.failures and not streams.mismatches, (streams.failures[:3], streams.mismatches[:3])
    assert rv2 > rv
    won = [p for r in routers for p in r.status()["cluster"]["promotions"] if p["previous"] == first]
    node_won = [p for p in node.status()["cluster"]["promotions"] if p["previous"] == first]
    assert len(won) + len(node_won) == 1, (won, node_won)  # three routers saw it; one CAS won
    assert (won or node_won)[0]["revision"] == rv2  # the fencing token is the Lease's resourceVersion
    out = subprocess.run(
        [sys.executable, "-m", "failover", "status", "--url", routers[1].url, "--token-file",
         str(routers[1].token_path)], capture_output=True, text=True, timeout=30, check=True).stdout
    assert "chat-0@a" in out and "chat-1@a" in out and str(rv2) in out, out


def test_a_node_that_stops_is_dropped_by_the_routers_on_kubernetes_leases(k8s):
    api, node, routers = k8s
    wait_until(lambda: all(r.status()["cluster"]["instances"] for r in routers), 20, "instances known")
    assert node.stop() == 0
    # a clean stop deletes its heartbeat and every Lease under it; the routers' poll sees them go
    wait_until(lambda: all(not r.status()["cluster"]["instances"] and not r.status()["cluster"]["nodes"]
                           for r in routers), 10, "the routers to drop the node")
    names = api.names()
    assert not [n for n in names if n.startswith(("failover-test-instances-", "failover-test-nodes-"))], names
    assert PRIMARY in names  # the primary key has no owner: only a CAS changes it

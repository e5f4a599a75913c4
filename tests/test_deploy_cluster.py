"""deploy/k8s/cluster: the manifests validate, the node config they render parses, the routers' args parse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from failover.config.schema import load_config
from router.cli import parser

CLUSTER = Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "cluster"


def docs(name: str) -> list[dict]:
    return list(yaml.safe_load_all((CLUSTER / name).read_text()))


def test_cluster_manifests_validate():
    manifests = sorted(map(str, CLUSTER.glob("*.yaml")))
    res = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", *manifests],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout + res.stderr
    for kind in ("daemonset/failover-cluster-node", "deployment/failover-router", "service/failover-routers",
                 "poddisruptionbudget/failover-router", "statefulset/failover-etcd", "role/failover-leases"):
        assert f"passed for resource {kind}" in out, out


def test_rendered_node_config_is_a_cluster_node(tmp_path):
    template = next(d for d in docs("nodes.yaml") if d["kind"] == "ConfigMap")["data"]["node.toml.in"]
    (tmp_path / "node.toml").write_text(template.replace("@NODE_NAME@", "gpu-7").replace("@POD_IP@", "10.1.2.3"))
    config = load_config(tmp_path / "node.toml")
    assert config.cluster is not None and config.cluster.node == "gpu-7" and config.engine_host == "10.1.2.3"
    assert len(config.cluster.etcd) == 3 and config.supervisor.daemon == "external"


def test_router_deployment_args_parse_as_a_peer_router():
    deploy = next(d for d in docs("routers.yaml") if d["kind"] == "Deployment")
    assert deploy["spec"]["replicas"] >= 2
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "router"
    a = parser().parse_args(args[1:])
    assert a.etcd and len(a.etcd[0].split(",")) == 3 and a.host == "0.0.0.0" and not a.backend
    pdb = next(d for d in docs("routers.yaml") if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] < deploy["spec"]["replicas"]

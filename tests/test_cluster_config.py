"""The [cluster] table of the node config: parsed, checked, and what it changes (engine address)."""

from __future__ import annotations

import pytest

from failover.config.argv import engine_argv
from failover.config.schema import ConfigError, parse_config

BASE = {"run_dir": "/tmp/x", "model": {"path": "/m", "device": "cpu", "dtype": "float32"},
        "service": [{"name": "chat", "port": 9100}]}


def with_cluster(**cluster) -> dict:
    return BASE | {"cluster": cluster}


def test_a_cluster_node_listens_on_its_cluster_address():
    config = parse_config(with_cluster(etcd=["http://127.0.0.1:2379"], node="gpu-1", host="10.0.0.2", ttl=3))
    assert config.cluster.ttl == 3 and config.cluster.name == "default"
    assert config.engine_host == "10.0.0.2"
    argv = engine_argv(config, config.service[0], 9100, 1 << 20)
    assert argv[argv.index("--host") + 1] == "10.0.0.2"
    assert parse_config(BASE).engine_host == "127.0.0.1" and parse_config(BASE).cluster is None


@pytest.mark.parametrize("cluster, needle", [
    ({"etcd": [], "node": "a"}, "cluster.etcd"),
    ({"etcd": ["http://e:2379"], "node": "a b"}, "cluster.node"),
    ({"etcd": ["http://e:2379"], "node": "a", "ttl": 0}, "ttl"),
    ({"etcd": ["http://e:2379"], "node": "a", "leader": True}, "leader"),
    ({"etcd": ["http://e:2379"]}, "node"),
    ({"node": "a", "backend": "consul"}, "cluster.backend"),
    ({"node": "a", "backend": "k8s"}, "cluster.namespace"),
])
def test_bad_cluster_tables_are_refused_with_the_key_named(cluster, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config(with_cluster(**cluster))


def test_a_kubernetes_backend_needs_no_etcd_and_finds_its_api_server_in_a_pod():
    from failover.cluster.node import make_store
    from failover_common.k8s_store import KubeStore

    config = parse_config(with_cluster(node="a", backend="k8s", namespace="failover", ttl=4))
    assert config.cluster.etcd == []
    store = make_store(config.cluster, {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    assert isinstance(store, KubeStore) and store.endpoints == ["https://10.96.0.1:443"]
    assert store.leases.namespace == "failover" and store.leases.cluster == "default" and store.poll == 0.5
    with pytest.raises(ValueError, match="API server"):
        make_store(config.cluster, {})

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
])
def test_bad_cluster_tables_are_refused_with_the_key_named(cluster, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config(with_cluster(**cluster))

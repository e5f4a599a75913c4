"""The node config: each bad input is refused before anything starts, with a message naming its key."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from failover.config.preflight import preflight
from failover.config.schema import ConfigError, load_config
from failover_common.sizes import parse_size
from supervisor_helpers import write_config

REPO = Path(__file__).resolve().parent.parent


def error_of(path: Path, *, machine: bool = False) -> str:
    with pytest.raises(ConfigError) as info:
        config = load_config(path)
        if machine:
            preflight(config)
    return str(info.value)


def test_example_cpu_config_parses_and_passes_preflight(tiny_model, run_dir):
    path = write_config(run_dir / "node.toml", model=tiny_model, run_dir=run_dir / "run")
    config = load_config(path)
    preflight(config)
    assert config.service[0].kind == "online"
    assert len(config.service[0].ports) == 1 + config.service[0].standbys
    assert config.token_path.parent == run_dir / "run"


def test_shipped_examples_parse():
    for name in ("cpu.toml", "gpu.toml"):
        load_config(REPO / "deploy" / "examples" / name)


def test_typo_key_is_named_with_a_suggestion(tiny_model, run_dir):
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir, service_extra={"prot": 9000})
    msg = error_of(path)
    assert "service[0].prot: unknown key" in msg and "did you mean 'port'" in msg
    assert "allowed keys here:" in msg


def test_wrong_type_names_its_key_path(tiny_model, run_dir):
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir, router={"probe_interval": "fast"})
    assert "router.probe_interval: expected a number, got a string" in error_of(path)


def test_bad_value_lists_allowed_values(tiny_model, run_dir):
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir, service_extra={"kind": "bulk"})
    msg = error_of(path)
    assert "service[0].kind: 'bulk' is not allowed; allowed: 'online', 'batch'" in msg


def test_missing_model_path(run_dir):
    path = write_config(run_dir / "c.toml", model=run_dir / "nope", run_dir=run_dir)
    msg = error_of(path, machine=True)
    assert "model.path:" in msg and "does not exist" in msg and "failover tiny-model" in msg


def test_tp_that_does_not_split_the_model(tiny_model, run_dir):
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir, model_extra={"tp": 3})
    msg = error_of(path, machine=True)
    heads = json.loads((tiny_model / "config.json").read_text())["num_attention_heads"]
    assert f"model.tp: 3 does not divide num_attention_heads = {heads}" in msg


def test_port_in_use(tiny_model, run_dir):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir, router={"port": port})
        assert f"router.port: port {port} is in use" in error_of(path, machine=True)


def test_two_services_on_one_port(tiny_model, run_dir):
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir, second_service=True, clash=True)
    msg = error_of(path)
    assert "service[1].port: port" in msg and "also used by service[0] (chat)" in msg


def test_kv_budgets_that_do_not_fit_in_memory(tiny_model, run_dir):
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir, service_extra={"kv_memory": "100TiB"})
    msg = error_of(path, machine=True)
    assert "service[*].kv_memory: the instances' KV budgets" in msg and "MemAvailable" in msg


def test_not_enough_ports_for_the_standbys(tiny_model, run_dir):
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir,
                        service_extra={"port": None, "port_range": [20001, 20001], "standbys": 2})
    assert "service[0].port_range: [20001, 20001] holds 1 port(s)" in error_of(path)


def test_all_problems_reported_at_once(tiny_model, run_dir):
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir,
                        service_extra={"kv_memory": "lots", "command": ["vllm", "{prot}"]})
    msg = error_of(path)
    assert "2 problems" in msg and "service[0].kv_memory" in msg and "unknown placeholder {prot}" in msg


def test_not_toml_and_not_found(run_dir):
    (run_dir / "bad.toml").write_text("run_dir = \n")
    assert "not valid TOML" in error_of(run_dir / "bad.toml")
    assert "file not found" in error_of(run_dir / "missing.toml")


def test_sizes():
    assert parse_size("256MiB") == 256 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(4096) == 4096
    with pytest.raises(ValueError):
        parse_size("ten megs")


def test_router_body_limits_reach_the_router_and_bad_ones_are_named(tiny_model, run_dir):
    from failover.node.bridge import router_config

    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir,
                        router={"max_body": "1MiB", "max_buffered": "8MiB", "body_timeout": 2.5,
                                "max_upstream": 7, "upstream_queue_size": 9, "loop_lag_tolerance": 0.3,
                                "replace_settle_timeout": 0.0})
    rc = router_config(load_config(path))
    assert (rc.max_body_bytes, rc.max_buffered_bytes, rc.body_timeout) == (2**20, 8 * 2**20, 2.5)
    assert (rc.max_upstream, rc.upstream_queue_size, rc.loop_lag_tolerance, rc.replace_settle_timeout) == (7, 9, 0.3, 0.0)
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir,
                        router={"max_body": "2MiB", "max_buffered": "1MiB"})
    assert "router.max_buffered: '1MiB' is less than router.max_body ('2MiB')" in error_of(path)
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir, router={"max_body": "lots"})
    assert "router.max_body: 'lots' is not a size" in error_of(path)


def test_cpu_threads_share_the_cores_among_engines_that_compute_at_once(tiny_model, run_dir):
    from failover.config.argv import engine_argv, share
    from failover.config.schema import parse_config

    # one core kept for the router, the supervisor and a starting standby; the rest shared out
    assert [share(cores, busy) for cores, busy in ((1, 1), (2, 1), (16, 1), (2, 2), (16, 2), (8, 4), (64, 3))] \
        == [1, 1, 15, 1, 7, 1, 21]
    cores = len(os.sched_getaffinity(0))

    def threads(services: list[dict], device: str = "cpu", tp: int = 1) -> list[str | None]:
        config = parse_config({"run_dir": str(run_dir / "run"),
                               "model": {"path": str(tiny_model), "device": device, "tp": tp},
                               "service": services}, source="test")
        out = []
        for svc in config.service:
            argv = engine_argv(config, svc, 9000, 1 << 20)
            out.append(argv[argv.index("--cpu-threads") + 1] if "--cpu-threads" in argv else None)
        return out

    chat = {"name": "chat", "port": 9100}
    batch = {"name": "offline", "kind": "batch", "standbys": 0, "port": 9200,
             "batch": {"input": str(run_dir / "in.jsonl"), "output": str(run_dir / "out.jsonl")}}
    assert threads([chat]) == [str(share(cores, 1))]  # alone (its standby waits idle)
    assert threads([chat, batch]) == [str(share(cores, 2))] * 2  # co-serving: both compute
    assert threads([chat], tp=2) == [str(share(cores, 2))]  # per rank
    assert threads([chat | {"cpu_threads": 3}, batch]) == ["3", str(share(cores, 2))]  # as set
    assert threads([chat], device="cuda") == [None]  # torch's default
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir,
                        service_extra={"engine": "vllm", "cpu_threads": 2})
    assert "service[0].cpu_threads: sets the bundled engine's torch threads; this service runs vLLM" in error_of(path)
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir, service_extra={"cpu_threads": 0})
    assert "service[0].cpu_threads" in error_of(path)

"""A hot standby holds a small KV pool; the promoted instance grows to the primary's, the old one
shrinks back (a real `failover up` on CPU, the tiny model)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from failover.config.kv import block_bytes, min_pool_bytes
from supervisor_helpers import Load, Node, wait_until, write_config
from test_config import error_of

MIB = 1 << 20


def event(line: str) -> dict | None:
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and "event" in doc else None


def pools(node) -> dict[str, tuple[str, int | None]]:
    """instance -> (role, kv_bytes) as `failover status --json` shows them."""
    return {name: (i["role"], i.get("kv_bytes")) for name, i in node.instances().items()}


@pytest.fixture
def node(procs, tiny_model, run_dir):
    # the tiny model's longest context (512 tokens) needs 256 KiB of KV: the primary's floor; a
    # standby's pool may be smaller (one block is 8 KiB)
    n = Node(procs, tiny_model, run_dir, service_extra={"kv_memory": "2MiB", "standby_kv_memory": "64KiB"})
    yield n
    n.stop()


def test_standby_is_small_and_the_promoted_instance_grows_after_a_kill(node):
    primary, standby = wait_until(node.serving_pair, 30, "a ready pair")
    assert pools(node) == {primary["name"]: ("primary", 2 * MIB), standby["name"]: ("standby", MIB // 16)}
    load = Load(node.url)
    load.start()
    wait_until(lambda: load.total() >= 5, 30, "some traffic")
    os.kill(primary["pid"], signal.SIGKILL)
    wait_until(lambda: pools(node)[standby["name"]] == ("primary", 2 * MIB), 20, "the promoted pool grown")
    back = wait_until(lambda: (p := node.serving_pair()) and p[1]["pid"] != primary["pid"] and p, 30,
                      "the replacement standby")
    assert pools(node)[back[1]["name"]] == ("standby", MIB // 16)  # the replacement is small again
    seen = load.total()
    wait_until(lambda: load.total() >= seen + 5, 30, "traffic after the failover")
    load.stop()
    assert load.failures == [], load.failures[:5]
    record = node.status()["last_failover"]["chat"]
    assert record["new"] == standby["name"] and record["kv_grown_ms"] >= 0
    events = [e for e in map(event, node.log().splitlines()) if e]
    assert any(e["event"] == "promoted_pool_grown" for e in events)
    # the growth asked for memory only once the killed primary's process was gone
    order = [e["event"] for e in events if e["event"] in ("failed_primary_released", "kv_resized")
             and e.get("slot") == standby["name"]]
    assert order == ["failed_primary_released", "kv_resized"], order
    released = next(e for e in events if e["event"] == "failed_primary_released")
    assert primary["pid"] in released["pids"]


def test_planned_promote_swaps_the_budgets(node):
    primary, standby = wait_until(node.serving_pair, 30, "a ready pair")
    res = node.cli("promote", "--to", standby["name"])
    assert res.returncode == 0, res.stderr
    wait_until(lambda: pools(node) == {standby["name"]: ("primary", 2 * MIB),
                                      primary["name"]: ("standby", MIB // 16)}, 20, "the budgets swapped")
    table = node.cli("status").stdout
    assert "2.0MiB" in table and "0.1MiB" in table  # the KV column


def test_budgets_that_cannot_work_are_refused_naming_the_key(tiny_model, run_dir):
    floor = min_pool_bytes(str(tiny_model), "float32", 1, None)
    assert floor == 256 * 1024  # 512 positions / 16 per block x 8 KiB per block (2 layers, 2 kv heads x 16, fp32)
    block = block_bytes(str(tiny_model), "float32", 1)
    assert block == 8 * 1024
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir,
                        service_extra={"kv_memory": "2MiB", "standby_kv_memory": "4MiB"})
    assert "service[0].standby_kv_memory: '4MiB' is more than kv_memory ('2MiB')" in error_of(path)
    # a standby's pool may be below one full context, but not below one block
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir,
                        service_extra={"kv_memory": "2MiB", "standby_kv_memory": "4KiB"})
    msg = error_of(path, machine=True)
    assert "service[0].standby_kv_memory: '4KiB' is less than one KV block" in msg and f"minimum is {block} bytes" in msg
    # the primary's must hold one sequence of the longest context ...
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir,
                        service_extra={"kv_memory": "128KiB", "standby_kv_memory": "64KiB"})
    msg = error_of(path, machine=True)
    assert "service[0].kv_memory: '128KiB' holds no sequence" in msg and f"minimum is {floor} bytes" in msg
    # ... but a shorter max_model_len makes a small pool enough
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir,
                        service_extra={"kv_memory": "128KiB", "standby_kv_memory": "16KiB", "max_model_len": 64})
    from failover.config.preflight import preflight
    from failover.config.schema import load_config

    preflight(load_config(path))
    # what does not fit says by how much, with each pool's share
    path = write_config(run_dir / "c.toml", model=tiny_model, run_dir=run_dir,
                        service_extra={"kv_memory": "64TiB", "standby_kv_memory": "1TiB", "standbys": 2})
    msg = error_of(path, machine=True)
    assert "chat primary 65536.00" in msg and "chat 2 standby(s) 2048.00" in msg and "GiB; lower" in msg

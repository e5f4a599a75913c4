"""A vLLM batch service (``kind = "batch"``, ``engine = "vllm"``) beside a vLLM online service, both on
the cache daemon's weights, under `failover up`, as real processes.

One node for the whole scenario (each vLLM start costs ~30-90 s on the shared 2-core machine): the
batch engine maps the daemon's arena like the online one (``cpu_gemm = "prepack"`` from the config
reaches both model loaders); an operator preemption ends its whole process tree (no process, no
/dev/shm file left) and verifies the memory free; a spike of online requests evicts it again (the
load trigger), calm brings it back; the output then holds every input id exactly once, each result
equal to the online service's answer to the same greedy request (same weights, same kernels).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import openai
import pytest

from coserve_helpers import Burst, CoNode, batch_input, node_config, read_output
from failover.coserve.load import engine_totals
from failover.procs.smaps import tree_memory
from failover.procs.tree import group_members, mapped_shm
from supervisor_helpers import wait_until
from vllm_helpers import READY_TIMEOUT, VLLM_FLAGS, needs_vllm, vllm_checkpoint

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.timeout(900)]
ITEMS = 48  # enough that the batch is still running at both preemptions (checked)
MAX_TOKENS = 32
VLLM = {"engine": "vllm", "engine_args": VLLM_FLAGS, "kv_memory": "256MiB", "standbys": 0, "max_batch": 8,
        "cpu_gemm": "prepack"}


def _answers(url: str, lines: list[dict]) -> dict[str, tuple]:
    """id -> (text, finish_reason, completion tokens) of each batch line, asked of the online service
    with the openai SDK: what an uninterrupted run of the batch must hold."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    out = {}
    try:
        for line in lines:
            if "prompt" in line:
                r = c.completions.create(model="chat", prompt=line["prompt"], max_tokens=line["max_tokens"],
                                         temperature=0)
                out[line["id"]] = (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens)
            else:
                body = line["body"]
                r = c.chat.completions.create(model="chat", messages=body["messages"],
                                              max_tokens=body["max_tokens"], temperature=0)
                out[line["custom_id"]] = (r.choices[0].message.content, r.choices[0].finish_reason,
                                          r.usage.completion_tokens)
    finally:
        c.close()
    return out


def http_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def _parse(text: str) -> dict | None:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _got(record: dict) -> tuple:
    body = record["response"]["body"]
    choice = body["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return text, choice["finish_reason"], body["usage"]["completion_tokens"]


def _running(node: CoNode) -> dict:
    return wait_until(lambda: (b := node.batch("bulk"))["state"] == "running"
                      and node.slot("bulk-0")["state"] == "running" and b, READY_TIMEOUT, "the vLLM batch running")


def _check_weights(node: CoNode, slot_name: str) -> int:
    """The slot's vLLM instance maps the daemon's arena (no private page of it) with cpu_gemm from
    the config; returns its pid."""
    slot = node.slot(slot_name)
    assert slot["weights_source"] == "cache", slot
    info = slot["weights"]
    assert info["cpu_gemm"] == "prepack" and info["repacked_bytes"] > 0, info  # oneDNN's copy, as configured
    arena = tree_memory(group_members(slot["pid"]))["arena"]
    assert arena["Rss"] > 0 and arena["Private_Clean"] + arena["Private_Dirty"] == 0, arena
    node.seen_pids |= set(group_members(slot["pid"]))
    return slot["pid"]


def test_a_vllm_batch_service_on_cached_weights_is_preempted_and_resumed_losing_nothing(procs, run_dir):
    run_dir = Path(run_dir)
    model = vllm_checkpoint(run_dir / "model")
    ids = batch_input(run_dir / "in.jsonl", ITEMS, max_tokens=MAX_TOKENS)
    lines = [_parse(s) for s in (run_dir / "in.jsonl").read_text().splitlines()]
    lines = [line for line in lines if line and ("prompt" in line or "body" in line)]  # not the bad lines
    config = node_config(run_dir / "node.toml", model=model, run_dir=run_dir / "node", services=[
        {"name": "chat", "kind": "online", "priority": 100, **VLLM},
        {"name": "bulk", "kind": "batch", "priority": 10, **VLLM,
         "batch": {"input": str(run_dir / "in.jsonl"), "output": str(run_dir / "out.jsonl"), "concurrency": 2,
                   "queue_high": 4, "queue_low": 1, "ttft_high": 1000.0, "ttft_low": 999.0,  # load = queue depth
                   "hold": 1.0, "sample_interval": 0.1, "evict_timeout": 0.5}},
    ], router={"probe_timeout": 2.0, "probe_threshold": 3},
        supervisor={"ready_timeout": READY_TIMEOUT, "stop_timeout": 10.0})
    node = CoNode.__new__(CoNode)
    shm_before = set(os.listdir("/dev/shm"))
    node._launch(procs, run_dir, config, ready_timeout=READY_TIMEOUT)
    try:
        _running(node)
        _check_weights(node, "chat-0")
        first = _check_weights(node, "bulk-0")
        members = group_members(first)
        shm = set().union(*(mapped_shm(p) for p in members))
        assert len(members) >= 3 and shm, (members, shm)  # API server, EngineCore, Worker; its /dev/shm files

        # 1. an operator's preemption mid-batch: the whole tree gone, its files removed, memory verified
        wait_until(lambda: node.batch("bulk")["done"] >= 3, 120, "batch results")
        res = node.cli("preempt", "bulk")
        assert res.returncode == 0, res.stderr
        b = wait_until(lambda: (b := node.batch("bulk"))["preemptions"] == 1 and b, 30, "the eviction")
        assert b["state"] == "preempted" and b["done"] < b["total"], b  # not finished before it
        assert b["last_preempt"]["memory_verified"] is True, b["last_preempt"]
        assert not group_members(first), "a process of the evicted vLLM tree is left"
        assert not [f for f in shm if os.path.exists(f)], "the evicted tree's /dev/shm files are left"
        done = b["done"]
        want = _answers(node.url, lines)  # the online service serves while the batch is out
        assert node.batch("bulk")["done"] == done  # nothing ran while preempted
        # the load trigger reads vLLM's own metric names from the online primary's /metrics
        ttft_sum, ttft_count, waiting = engine_totals(http_text(f"http://127.0.0.1:{node.slot('chat-0')['port']}"
                                                                "/metrics"))
        assert ttft_count >= len(lines) and ttft_sum > 0 and waiting == 0, (ttft_sum, ttft_count, waiting)
        res = node.cli("resume", "bulk")
        assert res.returncode == 0, res.stderr

        # 2. a spike of online requests evicts it (queue depth over queue_high), calm brings it back
        b = _running(node)
        assert b["done"] < b["total"], "the batch finished too early for the test"
        second = _check_weights(node, "bulk-0")
        assert second != first
        spikes: list[str] = []
        deadline = time.monotonic() + 60
        while node.batch("bulk")["preemptions"] < 2:
            assert time.monotonic() < deadline, "no load eviction after 60 s of spikes"
            spikes += Burst(node.url, 12, max_tokens=48).join()
        assert spikes == [], spikes[:5]
        b = node.batch("bulk")
        assert b["last_preempt"]["reason"] == "load" and b["last_preempt"]["memory_verified"] is True, b
        wait_until(lambda: not group_members(second), 30, "the second tree gone")
        wait_until(lambda: node.batch("bulk")["state"] == "done", READY_TIMEOUT + 120, "the batch done")
        b = node.batch("bulk")
        assert b["resumes"] == 2, b
    finally:
        resumed, evicted = node.events("batch_resumed"), node.events("batch_preempted")
        node.stop()
    for e in evicted + resumed:  # the figures docs/vllm.md quotes (-s)
        print({k: e.get(k) for k in ("event", "reason", "term_to_gone_ms", "trigger_to_memory_free_ms",
                                     "ready_ms", "first_result_ms", "cut_off")})

    out = read_output(run_dir / "out.jsonl")
    assert Counter(r["id"] for r in out) == Counter(ids)  # every id exactly once
    got = {r["id"]: _got(r) for r in out if r["error"] is None}
    assert got == want
    assert sum(r["error"] is not None for r in out) == 2  # the two bad lines, recorded as errors
    assert [e.get("ready_ms") is not None for e in resumed if e["service"] == "bulk"] == [True, True], resumed
    new = {f for f in os.listdir("/dev/shm") if f.startswith(("psm_", "sem.mp-"))} - shm_before
    assert not new, f"/dev/shm files left behind: {new}"

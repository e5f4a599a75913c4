"""vLLM weights from failover's cache daemon (``--load-format failover``), as real processes.

One daemon packs vLLM's own loading of the tiny checkpoint (``--engine vllm``); real vLLM servers
then map it: their greedy tokens (and, with ``cpu_gemm = prepack``, their logprobs bit for bit) equal
vLLM's own disk load; two instances share the arena's pages (Pss about half the Rss, nothing private);
a server built with other settings is refused with the differing fields; a server without a daemon
refuses to start (the documented fallback) unless told ``fallback = disk``; ``failover up`` with
``weights = "disk"`` runs vLLM without a daemon. That ``failover up``'s vLLM primary and standby
report weights from the daemon and share them, and that a killed primary's replacement maps them
again, is checked in test_vllm_node.py, on the node that test starts anyway.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import openai
import pytest

from failover_common.ports import free_port
from failover.procs.smaps import tree_memory
from failover.procs.tree import group_members
from supervisor_helpers import Node, write_config
from vllm_helpers import READY_TIMEOUT, VLLM_FLAGS, VllmServer, needs_vllm, packing_daemon, vllm_checkpoint

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.timeout(900)]
PROMPTS = ["once upon a time", "the quick brown fox", "1 2 3 4"]
MAX_TOKENS = 12


def _ask(url: str) -> dict[str, tuple[list[str], list[float]]]:
    """prompt -> (greedy tokens, their logprobs) from ``url``, as the openai SDK gets them."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        out = {}
        for p in PROMPTS:
            r = c.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
            out[p] = (r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs)
        return out
    finally:
        c.close()


def _extra(sock: Path, **options) -> tuple[str, ...]:
    return ("--load-format", "failover", "--model-loader-extra-config", json.dumps({"socket": str(sock), **options}))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """A cache daemon holding vLLM's layout of the tiny checkpoint; stopped at the end."""
    base = tmp_path_factory.mktemp("vw")
    model = vllm_checkpoint(base / "model")
    with packing_daemon(model, "vw") as sock:
        yield model, sock, base


@pytest.fixture
def servers():
    started: list[VllmServer] = []
    yield started
    for s in started:
        s.stop()


def _server(servers, model: Path, base: Path, name: str, *extra: str) -> VllmServer:
    s = VllmServer(model, free_port(), base / f"{name}.log", extra=extra)
    servers.append(s)
    return s


def test_vllm_maps_the_daemons_weights_shares_them_and_answers_as_its_own_disk_load(daemon, servers):
    model, sock, base = daemon
    reports = {n: base / f"{n}.weights.json" for n in ("a", "b", "prepack")}
    disk = _server(servers, model, base, "disk")
    a = _server(servers, model, base, "a", *_extra(sock, report=str(reports["a"])))
    b = _server(servers, model, base, "b", *_extra(sock, report=str(reports["b"])))
    prepack = _server(servers, model, base, "prepack", *_extra(sock, cpu_gemm="prepack", report=str(reports["prepack"])))
    for s in servers:
        s.wait_ready()

    # every instance says where its weights came from: the daemon, its parameters left in the arena
    for name in ("a", "b"):
        info = json.loads(reports[name].read_text())
        assert info["source"] == "cache" and info["repacked_bytes"] == 0, info
        assert info["shared_bytes"] > 10 * info["copied_bytes"], info  # buffers only are copied
    pre = json.loads(reports["prepack"].read_text())
    assert pre["source"] == "cache" and pre["repacked_bytes"] > 0, pre  # oneDNN's own copy of each linear

    # the answers: greedy tokens as vLLM's disk load gives them; bit-equal logprobs with vLLM's kernels
    want = _ask(disk.url)
    for s in (a, b):
        got = _ask(s.url)
        for p in PROMPTS:
            assert got[p][0] == want[p][0], (p, got[p][0], want[p][0])
            assert max(abs(x - y) for x, y in zip(got[p][1], want[p][1])) < 1e-3, (p, got[p][1], want[p][1])
    assert _ask(prepack.url) == want

    # the pages of the arena are shared between the two instances, not copied into either
    trees = {s: group_members(s.proc.pid) for s in (a, b, disk)}
    mem = {s: tree_memory(pids) for s, pids in trees.items()}
    for s in (a, b):
        arena = mem[s]["arena"]
        assert arena["Rss"] > 0, mem[s]  # mapped and resident
        assert arena["Private_Clean"] + arena["Private_Dirty"] == 0, arena
        assert arena["Pss"] * 2 <= arena["Rss"] + 8192 * 4, arena  # split between (at least) a, b and prepack
    assert mem[disk]["arena"]["Rss"] == 0  # vLLM's own load maps nothing of ours


def test_a_vllm_built_with_other_settings_or_without_a_daemon_is_refused_unless_told_to_load_from_disk(
        daemon, servers, tmp_path):
    """Three servers started together (each vLLM start is mostly one core's work): one built with
    another dtype than the daemon's, one without a daemon, one without a daemon told to fall back."""
    model, sock, base = daemon
    missing = Path(os.path.realpath("/tmp")) / f"fo-none-{os.getpid()}.sock"
    other = _server(servers, model, base, "other", *_extra(sock), "--dtype", "bfloat16")
    refused = _server(servers, model, base, "refused", *_extra(missing))
    fallback = _server(servers, model, base, "fallback", *_extra(missing, fallback="disk",
                                                                  report=str(tmp_path / "f.json")))

    # 1. other settings than the daemon's: refused, the differing fields listed
    with pytest.raises(RuntimeError, match=r"exited"):
        other.wait_ready()
    message = other.log.read_text()
    assert "differing fields" in message and "dtype: 'bfloat16' != 'float32'" in message, \
        f"a vLLM with another dtype is not refused naming the field: {message[-3000:]}"

    # 2. no daemon: refused, saying how to load from disk instead
    with pytest.raises(RuntimeError, match="exited"):
        refused.wait_ready()
    message = refused.log.read_text()
    assert "no cache daemon at" in message and 'weights = "disk"' in message, \
        f"a vLLM without a daemon is not refused as documented: {message[-3000:]}"

    # 3. no daemon, fallback = disk: it loads from disk, loudly
    fallback.wait_ready()
    assert "failover_weights_fallback_disk" in fallback.log.read_text(), "the fallback to disk is not logged"
    assert json.loads((tmp_path / "f.json").read_text())["source"] == "disk", "the fallback does not report disk"


def test_weights_disk_runs_vllm_without_a_daemon(procs, run_dir):
    model = vllm_checkpoint(Path(run_dir) / "model")
    node = Node.__new__(Node)
    config = write_config(Path(run_dir) / "node.toml", model=model, run_dir=Path(run_dir) / "node",
                          service_extra={"engine": "vllm", "engine_args": VLLM_FLAGS, "kv_memory": "256MiB",
                                         "standbys": 0, "weights": "disk"},
                          supervisor={"ready_timeout": READY_TIMEOUT})
    node._launch(procs, Path(run_dir), config, ready_timeout=READY_TIMEOUT)
    try:
        slot = node.status()["supervisor"]["slots"][0]
        assert slot["weights_source"] == "disk"
        assert not node.status()["supervisor"]["daemon"]["pid"]
        assert not (Path(run_dir) / "node" / "daemon.sock").exists()
        assert tree_memory(group_members(slot["pid"]))["arena"]["Rss"] == 0
        assert b"--load-format" not in Path(f"/proc/{slot['pid']}/cmdline").read_bytes()
    finally:
        node.stop()

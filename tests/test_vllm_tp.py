"""vLLM with tensor parallelism (tp 2, gloo on CPU) on the cache daemon's weights, as real processes.

Under ``failover up`` with ``model.tp = 2``, the daemon's vLLM loader child starts one packer per
rank (failover_vllm.ranks), each a rank of a real tp group running vLLM's own sharded loading; the
daemon then holds one arena per rank and the packers leave no /dev/shm file. The node's tp-2 vLLM
instance (``--load-format failover``) maps them, each ``VLLM::Worker_TP<r>`` its own rank's arena and
no other, reports weights from the daemon, and answers as vLLM's own tp-2 disk load (a plain vLLM
server started beside the node) does; SIGINT leaves no process and no /dev/shm file (vLLM's CPU tp
all-reduce segments included). A rank that fails fails the daemon's load, naming the rank.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import openai
import pytest

from cache_daemon import client
from failover.procs.smaps import ARENA_TAG
from failover.procs.tree import group_members, mapped_shm
from failover_common.ports import free_port
from supervisor_helpers import Node, wait_until, write_config
from vllm_helpers import READY_TIMEOUT, VLLM_FLAGS, VllmServer, needs_vllm, vllm_checkpoint

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.timeout(900)]
TP = ("--tensor-parallel-size", "2")
NOBIND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # as the supervisor starts vLLM on CPU (2 cores, 2 ranks)
PROMPTS = ["once upon a time", "the quick brown fox", "1 2 3 4"]
MAX_TOKENS = 12


def _ask(url: str, model: str) -> dict[str, tuple[list[str], list[float]]]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        out = {}
        for p in PROMPTS:
            r = c.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
            out[p] = (r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs)
        return out
    finally:
        c.close()


def _workers(pgid: int) -> dict[int, int]:
    """tp rank -> pid of each ``VLLM::Worker_TP<rank>`` of the tree."""
    out = {}
    for pid in group_members(pgid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")[0].decode()
        if cmd.startswith("VLLM::Worker_TP"):
            out[int(cmd.removeprefix("VLLM::Worker_TP"))] = pid
    return out


def _arenas(pid: int) -> set[str]:
    """The daemon's arenas ``pid`` maps (their memfd names)."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split("memfd:", 1)[1].split()[0] for line in f if ARENA_TAG in line}


def test_a_tp2_vllm_under_failover_up_maps_each_ranks_arena_answers_as_its_own_tp2_disk_load_and_leaves_nothing(
        procs, run_dir):
    """One node (its daemon packs tp 2, its instance maps it) beside one vLLM tp-2 disk load, started
    together: each tp-2 start costs a minute or more on the shared 2-core machine."""
    run_dir = Path(run_dir)
    model = vllm_checkpoint(run_dir / "model")
    config = write_config(run_dir / "node.toml", model=model, run_dir=run_dir / "node", model_extra={"tp": 2},
                          service_extra={"engine": "vllm", "engine_args": VLLM_FLAGS, "kv_memory": "256MiB",
                                         "standbys": 0},
                          supervisor={"ready_timeout": READY_TIMEOUT, "stop_timeout": 10.0})
    shm_before = set(os.listdir("/dev/shm"))
    node = Node.__new__(Node)
    node._launch(procs, run_dir, config, ready_timeout=None)
    disk = None
    try:
        _check_packers(node, shm_before)
        # vLLM's own tp-2 disk load, started beside the node's instance
        disk = VllmServer(model, free_port(), run_dir / "disk.log", extra=TP, env=NOBIND)
        node.wait_ready(READY_TIMEOUT)
        try:
            shm = _check(node, disk)
        finally:
            node.stop()  # SIGINT: exit 0, no process and no run dir left (asserted)
    finally:
        if disk is not None:
            disk.stop()
    assert not [f for f in shm if os.path.exists(f)], "the tp-2 tree's /dev/shm files are left"
    new = set(os.listdir("/dev/shm")) - shm_before
    assert not new, f"/dev/shm files left behind: {new}"


def _check_packers(node: Node, shm_before: set[str]) -> None:
    """Once the daemon has packed (daemon.ready), no /dev/shm file made up to then is left: the
    packers' tp group left nothing (files made later are the vLLM instances', checked at the end)."""
    ready = node.config.daemon_ready_file
    wait_until(lambda: ready.exists() or node.proc.poll() is not None, READY_TIMEOUT, "the daemon's tp-2 pack")
    assert node.proc.poll() is None, node.log()[-3000:]
    packed_at = ready.stat().st_mtime_ns
    left = []
    for name in set(os.listdir("/dev/shm")) - shm_before:
        try:
            if os.stat(os.path.join("/dev/shm", name)).st_mtime_ns <= packed_at:
                left.append(name)
        except FileNotFoundError:
            pass
    assert not left, f"the packers' tp group left /dev/shm files: {left}"


def _check(node: Node, disk: VllmServer) -> set[str]:
    """The checks of the scenario, once both are up; returns the /dev/shm files of the node's tp-2 tree."""
    disk.wait_ready()
    slot = node.status()["supervisor"]["slots"][0]
    info = slot["weights"]
    assert slot["weights_source"] == "cache" and info["tp_size"] == 2 and info["shared_bytes"] > 0, slot
    held = client.status(node.config.daemon_socket).models
    assert sorted(m.tp_rank for m in held) == [0, 1] and len({m.key for m in held}) == 2, held
    members = group_members(slot["pid"])
    shm = set().union(*(mapped_shm(p) for p in members))
    node.seen_pids |= set(members)

    # each rank's worker maps its own rank's arena (the daemon's key for that rank), not the other's
    keys = {m.tp_rank: m.key for m in held}
    workers = _workers(slot["pid"])
    assert sorted(workers) == [0, 1], workers
    for rank, pid in workers.items():
        names = _arenas(pid)
        assert len(names) == 1 and keys[rank] in next(iter(names)), (rank, names, keys)
    assert not _arenas(disk.proc.pid) and not any(_arenas(p) for p in _workers(disk.proc.pid).values())

    # the answers (asked of the instance itself, as of the disk load): those of vLLM's own tp-2 disk load
    want, got = _ask(disk.url, "tiny"), _ask(f"http://127.0.0.1:{slot['port']}", "chat")
    for p in PROMPTS:
        assert got[p][0] == want[p][0], (p, got[p][0], want[p][0])
        assert max(abs(x - y) for x, y in zip(got[p][1], want[p][1])) < 1e-3, (p, got[p][1], want[p][1])
    # and through the router
    c = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=120)
    with c:
        r = c.completions.create(model="chat", prompt="once upon a time", max_tokens=8, temperature=0)
    assert r.usage.completion_tokens == 8
    return shm


def test_a_failing_rank_fails_the_daemons_load_naming_the_rank_and_leaves_no_packer(procs, tmp_path):
    """vLLM refuses the flags in every rank's packer (a context longer than the model's): the daemon's
    load fails with one rank's reason, the other packer is ended, and the daemon exits 1."""
    model = vllm_checkpoint(tmp_path / "model")
    run_dir = Path(os.path.realpath("/tmp")) / f"fo-vtpf-{os.getpid()}"
    run_dir.mkdir(mode=0o700)
    fd, log = procs.temp_file("vtpf-daemon-")
    try:
        proc = procs.python("-m", "cache_daemon", "--model", str(model), "--run-dir", str(run_dir), "--tp", "2",
                            "--engine", "vllm", "--dtype", "float32", "--engine-arg=--max-model-len=100000",
                            "--progress", "off", stderr=fd, stdout=fd)
        os.close(fd)
        assert proc.wait(READY_TIMEOUT) == 1, log.read_text()[-3000:]
        text = log.read_text()
        failed = [json.loads(line) for line in text.splitlines() if '"event": "load_failed"' in line]
        assert failed and failed[0]["message"].startswith(("PackError", "RankFailed")), text[-3000:]
        assert "rank 0: " in failed[0]["message"] or "rank 1: " in failed[0]["message"], failed
        assert "max_model_len" in failed[0]["message"] or "max-model-len" in failed[0]["message"], failed
        started = [json.loads(line) for line in text.splitlines() if "vllm_rank_packers_started" in line]
        assert started and not [p for p in started[0]["pids"] if os.path.exists(f"/proc/{p}")], started
    finally:
        for f in run_dir.iterdir():
            f.unlink()
        run_dir.rmdir()

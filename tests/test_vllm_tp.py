"""vLLM with tensor parallelism (tp 2, gloo on CPU) on the cache daemon's weights, as real processes.

The daemon's vLLM loader child starts one packer per rank (failover_vllm.ranks), each a rank of a
real tp group running vLLM's own sharded loading; the daemon then holds one arena per rank. A tp-2
vLLM server with ``--load-format failover`` maps them, each ``VLLM::Worker_TP<r>`` its own rank's
arena and no other, and answers as vLLM's own tp-2 disk load does. Then ``failover up`` with
``model.tp = 2``: the instance reports weights from the daemon, and SIGINT leaves no process and no
/dev/shm file (vLLM's CPU tp all-reduce segments included).
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
from supervisor_helpers import Node, write_config
from vllm_helpers import READY_TIMEOUT, VLLM_FLAGS, VllmServer, needs_vllm, packing_daemon, vllm_checkpoint

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.timeout(900)]
TP = ("--tensor-parallel-size", "2")
NOBIND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # as the supervisor starts vLLM on CPU (2 cores, 2 ranks)
PROMPTS = ["once upon a time", "the quick brown fox", "1 2 3 4"]
MAX_TOKENS = 12


def _ask(url: str) -> dict[str, tuple[list[str], list[float]]]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        out = {}
        for p in PROMPTS:
            r = c.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
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


def test_tp2_vllm_maps_each_ranks_arena_and_answers_as_its_own_tp2_disk_load(tmp_path):
    model = vllm_checkpoint(tmp_path / "model")
    shm_before = set(os.listdir("/dev/shm"))
    servers: list[VllmServer] = []
    try:
        with packing_daemon(model, "vtp", tp=2) as sock:
            held = client.status(sock).models
            assert sorted(m.tp_rank for m in held) == [0, 1] and len({m.key for m in held}) == 2, held
            assert not set(os.listdir("/dev/shm")) - shm_before  # the packers' tp group left nothing
            report = tmp_path / "cache.weights.json"
            extra = json.dumps({"socket": str(sock), "report": str(report)})
            disk = VllmServer(model, free_port(), tmp_path / "disk.log", extra=TP, env=NOBIND)
            servers.append(disk)
            cache = VllmServer(model, free_port(), tmp_path / "cache.log", env=NOBIND,
                               extra=(*TP, "--load-format", "failover", "--model-loader-extra-config", extra))
            servers.append(cache)
            for s in servers:
                s.wait_ready()
            info = json.loads(report.read_text())
            assert info["source"] == "cache" and info["tp_size"] == 2 and info["shared_bytes"] > 0, info

            # each rank's worker maps its own rank's arena (the daemon's key for that rank), not the other's
            keys = {m.tp_rank: m.key for m in held}
            workers = _workers(cache.proc.pid)
            assert sorted(workers) == [0, 1], workers
            for rank, pid in workers.items():
                names = _arenas(pid)
                assert len(names) == 1 and keys[rank] in next(iter(names)), (rank, names, keys)
            assert not _arenas(disk.proc.pid) and not any(_arenas(p) for p in _workers(disk.proc.pid).values())

            want, got = _ask(disk.url), _ask(cache.url)
            for p in PROMPTS:
                assert got[p][0] == want[p][0], (p, got[p][0], want[p][0])
                assert max(abs(x - y) for x, y in zip(got[p][1], want[p][1])) < 1e-3, (p, got[p][1], want[p][1])
    finally:
        for s in servers:
            s.stop()
    assert not set(os.listdir("/dev/shm")) - shm_before


def test_failover_up_runs_a_tp2_vllm_instance_on_the_daemons_weights(procs, run_dir):
    run_dir = Path(run_dir)
    model = vllm_checkpoint(run_dir / "model")
    config = write_config(run_dir / "node.toml", model=model, run_dir=run_dir / "node", model_extra={"tp": 2},
                          service_extra={"engine": "vllm", "engine_args": VLLM_FLAGS, "kv_memory": "256MiB",
                                         "standbys": 0},
                          supervisor={"ready_timeout": READY_TIMEOUT, "stop_timeout": 10.0})
    shm_before = set(os.listdir("/dev/shm"))
    node = Node.__new__(Node)
    node._launch(procs, run_dir, config, ready_timeout=READY_TIMEOUT)
    try:
        slot = node.status()["supervisor"]["slots"][0]
        assert slot["weights_source"] == "cache" and slot["weights"]["tp_size"] == 2, slot
        workers = _workers(slot["pid"])
        assert sorted(workers) == [0, 1] and all(_arenas(p) for p in workers.values()), workers
        shm = set().union(*(mapped_shm(p) for p in group_members(slot["pid"])))
        node.seen_pids |= set(group_members(slot["pid"]))
        c = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=120)
        with c:
            r = c.completions.create(model="chat", prompt="once upon a time", max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8
    finally:
        node.stop()  # SIGINT: exit 0, no process and no run dir left (asserted)
    assert not [f for f in shm if os.path.exists(f)], "the tp-2 tree's /dev/shm files are left"
    new = set(os.listdir("/dev/shm")) - shm_before
    assert not new, f"/dev/shm files left behind: {new}"


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

"""``bench/gpu_e2e.py --tp N``: the figures a tensor-parallel node adds, per rank and per GPU (issue 18).

- the daemon's load time and GB/s of each rank (its ``rank_loaded`` events);
- attach per rank: a fresh process maps rank r's arena (``cache_daemon.client.attach``), timed;
- each instance's rank processes (rank 0 and its children), and on CPU each rank's resident memory;
- on CUDA, memory per GPU: what the node uses there, what its processes are charged, and the rest
  (the resident weights), which must hold that GPU's shard once (< 1.5 x weights / N);
- that no rank of a killed or preempted tp=N instance outlives its rank 0.

The crash failover (client-seen, from the kill), the relaunch to ready and the batch preemption
are gpu_e2e.py's own rounds; with ``--tp N`` they run on tp=N instances.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpu_e2e_faults import log_events

from failover.coserve.release import descendants

REPO = Path(__file__).resolve().parent.parent

ATTACH = r"""
import json, sys, time
from cache_daemon.client import attach, preload
from cache_daemon.fingerprint import make_config
sock, model, dtype, device, tp, rank = sys.argv[1:7]
preload(device)  # what a zygote-forked engine has imported already
t = time.perf_counter()
w = attach(sock, make_config(model, dtype=dtype, tp_size=int(tp), tp_rank=int(rank), device=device))
ms = (time.perf_counter() - t) * 1e3
first = next(iter(w.tensors.values()))
print(json.dumps({"attach_ms": round(ms, 1), "bytes": sum(x.nbytes for x in w.tensors.values()),
                  "device": str(first.device)}), flush=True)
"""


def rank_loads(node_log: Path, report: dict) -> None:
    """The daemon's per-rank load: seconds and GB/s of each rank's arena."""
    for e in log_events(node_log, "rank_loaded"):
        r = e.get("rank")
        report[f"daemon_load_s_rank{r}"] = e.get("seconds")
        report[f"daemon_load_gbps_rank{r}"] = e.get("gbps")
        report[f"daemon_load_mib_rank{r}"] = round((e.get("bytes") or 0) / 2**20, 1)


def attach_per_rank(sock: Path, model: Path, dtype: str, device: str, tp: int, report: dict) -> None:
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    for r in range(tp):
        res = subprocess.run([sys.executable, "-c", ATTACH, str(sock), str(model), dtype, device, str(tp), str(r)],
                             capture_output=True, text=True, env=env, timeout=300)
        if res.returncode != 0:
            report[f"attach_rank{r}"] = f"failed: {(res.stderr.strip().splitlines() or ['?'])[-1][:160]}"
            continue
        out = json.loads(res.stdout.splitlines()[-1])
        report[f"attach_ms_rank{r}"] = out["attach_ms"]
        report[f"attach_mib_rank{r}"] = round(out["bytes"] / 2**20, 1)
        report[f"attach_device_rank{r}"] = out["device"]


def ranks_of(pid: int | None) -> list[int]:
    """Rank 0 and every live descendant of it (its tensor-parallel workers)."""
    return [] if pid is None else [pid, *descendants(pid)]


def instance_ranks(sup, service: str, report: dict, rss_bytes) -> dict[str, list[int]]:
    """Each instance's rank processes; on CPU each one's resident memory (the weights shared)."""
    out = {}
    for s in sup.slots.values():
        if s.service != service or s.pid is None:
            continue
        pids = out[s.name] = ranks_of(s.pid)
        report[f"{s.name}_rank_processes"] = len(pids)
        if sup.config.model.device == "cpu":
            for r, pid in enumerate(pids):
                report[f"{s.name}_rank{r}_rss_mib"] = round(rss_bytes(pid) / 2**20, 1)
    return out


def gpu_used_per_gpu(nvsmi) -> dict[str, int]:
    """MiB used on each GPU, by UUID."""
    return {uuid: int(used) for _, uuid, used in nvsmi("gpu=index,uuid,memory.used")}


def node_memory_per_gpu(nvsmi, base: dict[str, int], sup, nbytes: int, tp: int, report: dict) -> None:
    """Per GPU: what the node added, what its processes are charged, and the rest (the weights,
    held by no live process): it must be that GPU's shard once, not once per instance."""
    gpus = nvsmi("gpu=index,uuid,memory.used")
    apps = nvsmi("compute-apps=gpu_uuid,pid,used_memory")
    names = {str(pid): s.name for s in sup.slots.values() for pid in ranks_of(s.pid)}
    shard = nbytes / tp
    for index, uuid, used in gpus[:tp]:
        node = int(used) - base.get(uuid, 0)
        charged = [(pid, int(mib)) for u, pid, mib in apps if u == uuid]
        per_process = sum(mib for _, mib in charged)
        rest = node - per_process
        report[f"gpu{index}_used_by_node_gib"] = round(node / 1024, 2)
        report[f"gpu{index}_charged_to_processes_gib"] = round(per_process / 1024, 2)
        report[f"gpu{index}_not_charged_gib"] = round(rest / 1024, 2)
        report[f"gpu{index}_weights_counted_once"] = int(rest * 2**20 < 1.5 * shard)
        report[f"gpu{index}_apps"] = ";".join(f"{names.get(pid, pid)}/{mib}" for pid, mib in charged)


def ranks_left(pids: list[int]) -> int:
    """How many of ``pids`` are still alive (zombies count as gone)."""
    left = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                left += f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            pass
    return left

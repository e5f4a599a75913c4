"""``bench/engine.py --tp N``: decode with N tensor-parallel ranks against tp=1 on the same model.

Both run the same way, so they compare: a ``failover engine`` server (``--tp 1``, then ``--tp N``;
weights from disk; on CUDA rank r on GPU r, NCCL; on CPU gloo ranks, a plumbing check), B streamed
completions sent at once (random prompt ids, ``ignore_eos``, greedy), and

    decode tok/s = B x (T - 1) / (last token of any stream - first token of the earliest stream)

(median of ``--runs``), so without the prefill, as engine_decode.py counts it in process. The
token ids of every tp=N stream must equal tp=1's (greedy): printed as ``tokens_equal_tp1``. Figures
go through HTTP on both sides, so they sit below the in-process ones of engine_decode.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _server(model: Path, args, tp: int, port: int, batch: int, log) -> subprocess.Popen:
    kv = "64MiB" if args.device == "cpu" else f"{args.kv_gib}GiB"
    cmd = [sys.executable, "-m", "failover", "engine", "--model", str(model), "--port", str(port),
           "--weights", "disk", "--device", args.device, "--tp", str(tp), "--kv-memory", kv,
           "--max-batch", str(batch), "--served-model-name", "m", "--log-level", "warning"]
    if args.no_graphs:
        cmd.append("--no-cuda-graphs")
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)


async def _stream(session, url: str, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    body = {"model": "m", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
            "stream": True}
    ids, times = [], []
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"engine answered {r.status}: {(await r.text())[:200]}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            got = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if got:
                ids += got
                times.append(time.perf_counter())
    return ids, times


async def _decode(url: str, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        outs = await asyncio.gather(*(_stream(s, url, p, new) for p in prompts))
    first = min(t[0] for _, t in outs)
    last = max(t[-1] for _, t in outs)
    return len(prompts) * (new - 1) / (last - first), [ids for ids, _ in outs]


def _ready(port: int, proc: subprocess.Popen, log: Path, timeout: float = 900.0) -> dict:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the tp engine exited ({proc.returncode}) before it was ready; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                body = json.loads(r.read())
                if body.get("ready"):
                    return body
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise SystemExit(f"the tp engine was not ready within {timeout:.0f} s")


def bench_tp_decode(model: Path, args, work: Path) -> dict:
    """{tp: {batch: tok/s}}, the tp=N ranks seen, and whether tp=N's greedy ids equal tp=1's."""
    from failover_common.ports import free_port
    from failover.coserve.release import descendants

    batches = [int(b) for b in args.tp_batches.split(",")]
    rng = random.Random(0)
    prompts = {b: [[rng.randrange(3, 500) for _ in range(args.prompt_len)] for _ in range(b)] for b in batches}
    results: dict = {"tok_s": {}, "ids": {}, "ranks": {}}
    for tp in (1, args.tp):
        port = free_port()
        path = work / f"engine-tp{tp}.log"
        with open(path, "ab") as log:
            proc = _server(model, args, tp, port, max(batches), log)
            try:
                body = _ready(port, proc, path)
                results["ranks"][tp] = 1 + len(descendants(proc.pid))
                results.setdefault("ready", {})[tp] = body.get("startup_seconds")
                url = f"http://127.0.0.1:{port}"
                asyncio.run(_decode(url, prompts[batches[0]], 4))  # warm the path once
                for b in batches:
                    runs = []
                    for _ in range(args.runs):
                        rate, ids = asyncio.run(_decode(url, prompts[b], args.new_tokens))
                        runs.append(rate)
                    results["tok_s"].setdefault(tp, {})[b] = sorted(runs)[len(runs) // 2]
                    results["ids"].setdefault(tp, {})[b] = ids
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
    results["tokens_equal_tp1"] = int(results["ids"][1] == results["ids"][args.tp])
    return results


def print_tp_decode(r: dict, args) -> None:
    n = args.tp
    print(f"\ndecode through HTTP, tp={n} vs tp=1 (same model, {args.device}; B streams at once, "
          f"{args.new_tokens} new tokens, greedy; median of {args.runs}):")
    print(f"  rank processes: tp=1 {r['ranks'][1]}, tp={n} {r['ranks'][n]}; in-process startup "
          f"tp=1 {r['ready'][1]} s, tp={n} {r['ready'][n]} s")
    for b, one in r["tok_s"][1].items():
        many = r["tok_s"][n][b]
        print(f"  batch {b:3d}: tp=1 {one:8.1f} tok/s   tp={n} {many:8.1f} tok/s   tp={n}/tp=1 {many / one:5.2f}x")
    print(f"  tp={n} greedy token ids equal tp=1's at every batch: {'yes' if r['tokens_equal_tp1'] else 'NO'}")

"""Helpers for the engine tests: in-process engines, real ``failover engine`` processes, HTTP calls,
a reference (transformers) forward, and a tensor-parallel rank script.

Run as a script it is one rank of a tp group that prints nothing and saves its logits:
``python tests/engine_helpers.py tp-logits MODEL RANK WORLD INIT_URL OUT [SOCKET]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # when run as a script
    sys.path.insert(0, str(REPO))

PROMPT_IDS = [5, 17, 42, 99, 3, 250, 7, 11, 300, 64, 128, 9]
READY_TIMEOUT_S = 60


# --- in-process ----------------------------------------------------------------------------------
def engine_config(model: Path, **kw):
    from engine.config import EngineConfig

    kw.setdefault("weights", "disk")
    return EngineConfig(model=Path(model), **kw)


def build_runner(model: Path, weights: dict | None = None, **kw):
    import torch

    from cache_daemon.checkpoint import load_shards
    from engine.config import ModelConfig
    from engine.model_runner import ModelRunner

    cfg = engine_config(model, **kw)
    if weights is None:
        weights = load_shards(model, dtype=getattr(torch, cfg.dtype), tp_size=cfg.tp, tp_rank=cfg.tp_rank,
                              transform=cfg.transform)
    return ModelRunner(cfg, ModelConfig.from_dir(model), weights)


def build_llm_engine(model: Path, **kw):
    from engine.llm_engine import LLMEngine
    from engine.tokenizer import Tokenizer

    runner = build_runner(model, **kw)
    tok = Tokenizer(model)
    return LLMEngine(runner, tok, runner.model_cfg.eos_token_ids + tok.eos_token_ids)


def make_seq(seq_id: str, prompt_ids: list[int], *, resume: list[int] | None = None, seed: int = 0, **params):
    from engine.sampling import SamplingParams
    from engine.sequence import Sequence

    params.setdefault("temperature", 0.0)
    return Sequence(seq_id, list(prompt_ids), SamplingParams(**params), seed, list(resume or []))


def run_engine(engine, seqs: list, join_at: dict[int, list] | None = None, max_steps: int = 10_000) -> dict:
    """Step until every sequence finished; ``join_at[step]`` sequences are added before that step.
    Returns {seq id: (token ids, text, finish reason)}."""
    join_at = dict(join_at or {})
    for seq in seqs:
        engine.add(seq)
    results: dict[str, list] = {}
    pending = {s.id for s in seqs} | {s.id for group in join_at.values() for s in group}
    for step in range(max_steps):
        for seq in join_at.pop(step, []):
            engine.add(seq)
        if not engine.has_work() and not join_at:
            break
        for out in engine.step():
            ids, text, _ = results.setdefault(out.seq_id, [[], "", None])
            results[out.seq_id] = [ids + out.token_ids, text + out.text, out.finish_reason]
    assert not engine.has_work() and set(results) == pending
    return {k: tuple(v) for k, v in results.items()}


def hf_logits(model: Path, ids: list[int]):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


# --- processes ---------------------------------------------------------------------------------
def start_engine(procs, model: Path, port: int, *args: str, wait: bool = True) -> subprocess.Popen:
    """Start ``failover engine``; its stderr (the JSON log) goes to a file at ``proc.log_path``
    (a pipe nobody reads would fill up and block the engine)."""
    fd, log_path = procs.temp_file("engine-")
    try:
        proc = procs.python("-m", "failover", "engine", "--model", str(model), "--port", str(port),
                            "--log-level", "info", *args, stderr=fd, stdout=subprocess.DEVNULL)
    finally:
        os.close(fd)
    proc.log_path = log_path
    if wait:
        wait_engine_ready(proc, port)
    return proc


def token_file(procs, token: str = "s3cret-engine-token") -> tuple[Path, dict]:
    """A 0600 token file (removed with ``procs``) and the Authorization header that carries it."""
    fd, path = procs.temp_file("engine-token-", suffix="")  # mkstemp: 0600, ours
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path, {"Authorization": f"Bearer {token}"}


def engine_log(proc: subprocess.Popen) -> str:
    return proc.log_path.read_text()


def wait_engine_ready(proc: subprocess.Popen, port: int, timeout: float = READY_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = engine_log(proc)[-3000:] if hasattr(proc, "log_path") else ""
            raise AssertionError(f"engine exited {proc.returncode}: {log}")
        status, body = get(port, "/ready")
        if status == 200:
            return body
        time.sleep(0.1)
    raise AssertionError("engine not ready in time")


def get(port: int, path: str, timeout: float = 5.0):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if r.headers.get_content_type() == "application/json" else raw.decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (urllib.error.URLError, ConnectionError):
        return None, None


def post(port: int, path: str, body, timeout: float = 30.0, raw: bytes | None = None,
         headers: dict | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sse_events(text: str) -> list:
    """The JSON events of an SSE body, then the literal "[DONE]"."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def metric(port: int, name: str) -> float:
    _, text = get(port, "/metrics")
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


# --- one tensor-parallel rank (script mode) --------------------------------------------------------
def tp_logits_main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from engine.config import ModelConfig
    from engine.distributed import init_group
    from engine.model_runner import ModelRunner
    from engine.weights import load_weights

    model, rank, world, init, out = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3], Path(argv[4])
    socket = Path(argv[5]) if len(argv) > 5 else None
    results = {}
    for source in ["disk"] + (["cache"] * (socket is not None)):
        cfg = engine_config(model, weights=source, socket=socket, tp=world, tp_rank=rank, dist_init=init)
        if not dist.is_initialized():
            init_group(cfg)
        loaded = load_weights(cfg)
        assert loaded.source == source
        runner = ModelRunner(cfg, ModelConfig.from_dir(model), loaded.tensors)
        results[source] = runner.all_logits(PROMPT_IDS)
        del runner
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from failover_common.logs import configure_logging

    configure_logging("warning")
    if sys.argv[1] == "tp-logits":
        sys.exit(tp_logits_main(sys.argv[2:]))
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")

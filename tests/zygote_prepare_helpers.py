"""A stand-in supervisor (a subreaper) for the zygote's prepare hook: fork targets whose module has
``prepare(argv)``, and real engines (``engine.cli:main``) of the tiny model; prints one JSON line.

    python tests/zygote_prepare_helpers.py MODEL LOG
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

PREPARED: list[list[str]] = []  # in the zygote: what prepare() was called with, inherited by later forks


def prepare(argv: list[str]) -> bool:
    if argv[:1] == ["boom"]:
        raise RuntimeError("boom")
    PREPARED.append(list(argv))
    return True


def main(argv: list[str]) -> int:
    """Exit code: 10 + how many prepares this fork inherited from the zygote."""
    return 10 + len(PREPARED)


def _ready(port: int, deadline: float) -> dict:
    import urllib.error
    import urllib.request

    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.05)
    raise TimeoutError(f"engine on {port} not ready")


async def scenario(model: Path, log_path: Path) -> dict:
    from openai import OpenAI

    from conftest import free_port
    from failover.procs.launch import Zygote
    from failover_common.proc import become_subreaper

    become_subreaper()
    out: dict = {}
    with open(log_path, "wb") as log:
        zygote = Zygote(preload="torch,engine.cli,engine.serve,zygote_prepare_helpers", stdout=log)
        hello = await zygote.start()
        rcs = []
        for argv in (["a"], ["b"], ["boom"], ["c"]):
            child = await zygote.fork("fo-prep", argv, target="zygote_prepare_helpers:main")
            rcs.append(await child.wait(20))
        out["rcs"], out["zygote_kept"] = rcs, zygote.hello.pid == hello.pid and zygote.restarts == 0

        texts = []
        for i in range(2):  # the first engine of the model loads it all; the second inherits the zygote's
            port = free_port()
            engine = await zygote.fork(f"fo-engine{i}", ["--model", str(model), "--port", str(port),
                                                         "--weights", "disk", "--kv-memory", "8MiB"])
            try:
                info = await asyncio.to_thread(_ready, port, time.monotonic() + 60)
                client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
                done = await asyncio.to_thread(client.completions.create, model=model.name,
                                               prompt="Failover in well", max_tokens=8, temperature=0)
                texts.append([done.choices[0].text, info["pid"]])
            finally:
                out.setdefault("engine_rcs", []).append(await engine.stop(10))
        out["texts"] = texts
        await zygote.stop()
    return out


if __name__ == "__main__":
    from failover_common.logs import configure_logging

    configure_logging("warning")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps(asyncio.run(scenario(Path(sys.argv[1]), Path(sys.argv[2])))), flush=True)

"""Helpers for the supervisor-side tests (zygote targets, config writers, process invariants)."""

from __future__ import annotations

import time


def child_main(argv: list[str]) -> int:
    """A zygote target for tests: sleep ``argv[1]`` seconds (default 0), exit with code ``argv[0]``."""
    if len(argv) > 1:
        time.sleep(float(argv[1]))
    return int(argv[0]) if argv else 0


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _table(values: dict) -> str:
    return "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items() if v is not None)


def write_config(path, *, model, run_dir, router: dict | None = None, service_extra: dict | None = None,
                 model_extra: dict | None = None, supervisor: dict | None = None,
                 second_service: bool = False, clash: bool = False) -> "Path":
    """A CPU config for the tiny model on free ports; keyword tables override or add keys."""
    from pathlib import Path

    from conftest import free_port

    service = {"name": "chat", "kind": "online", "priority": 100, "standbys": 1, "kv_memory": "8MiB",
               "port": free_port(), "max_batch": 8} | (service_extra or {})
    text = f'run_dir = {_toml_value(run_dir)}\n\n[model]\n' + _table(
        {"path": str(model), "dtype": "float32", "tp": 1, "device": "cpu", "transform": "none"} | (model_extra or {}))
    text += "\n[router]\n" + _table({"host": "127.0.0.1", "port": free_port(), "probe_interval": 0.2,
                                     "probe_timeout": 1.0, "probe_threshold": 2} | (router or {}))
    text += "\n[supervisor]\n" + _table({"ready_timeout": 60.0, "stop_timeout": 5.0, "drain_timeout": 5.0,
                                         "backoff_initial": 0.1} | (supervisor or {}))
    text += "\n[[service]]\n" + _table(service)
    if second_service:
        port = service["port"] + 1 if clash else free_port()
        text += "\n[[service]]\n" + _table({"name": "other", "standbys": 0, "port": port})
    Path(path).write_text(text)
    return Path(path)


# --- a stand-in supervisor for the zygote tests: a subreaper that forks through a real zygote -------

async def _zygote_scenario() -> dict:
    import asyncio
    import os
    import signal

    from failover.launch import Zygote
    from failover.processes import become_subreaper

    become_subreaper()
    out: dict = {"supervisor_pid": os.getpid()}
    zygote = Zygote(preload="torch,supervisor_helpers")
    hello = await zygote.start()
    out["zygote_pid"], out["import_s"] = hello.pid, hello.import_s

    quick = await zygote.fork("fo-quick", ["3", "0.2"], target="supervisor_helpers:child_main")
    with open(f"/proc/{quick.pid}/stat") as f:
        out["quick_ppid"] = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{quick.pid}/comm") as f:
        out["quick_comm"] = f.read().strip()
    out["quick_rc"] = await quick.wait(10)
    out["quick_runtime_s"] = quick.exited_at - quick.started

    # a long-lived child survives the zygote's death; the next fork restarts the zygote
    long = await zygote.fork("fo-long", ["0", "30"], target="supervisor_helpers:child_main")
    os.kill(hello.pid, signal.SIGKILL)
    await zygote.child.wait(10)
    await asyncio.sleep(0.2)
    out["long_alive_after_zygote_kill"] = long.alive
    again = await zygote.fork("fo-again", ["5"], target="supervisor_helpers:child_main")
    out["zygote_restarts"] = zygote.restarts
    out["again_rc"] = await again.wait(10)
    out["long_pid"] = long.pid
    out["zygote2_pid"] = zygote.hello.pid
    print(json.dumps(out), flush=True)
    await asyncio.sleep(60)  # the test SIGKILLs us here: PDEATHSIG must take the children along
    return out


if __name__ == "__main__":
    import asyncio
    import json
    import sys

    from cache_daemon.logs import configure_logging

    configure_logging("warning")
    if sys.argv[1:] == ["zygote-scenario"]:
        asyncio.run(_zygote_scenario())

"""Preflight for ``engine = "vllm"``: the interpreter that runs vLLM has vLLM, and failover's plugin.

vLLM loads failover's plugin (failover_vllm.plugin, entry point ``vllm.general_plugins``) in each of
its processes only where failover is installed in vLLM's own environment. Without it the node
still starts and serves, but: ``weights = "cache"`` has no loader, vLLM's processes outlive a
killed supervisor, and a stream migrated inside a character begins with its prompt's text
(failover_vllm.detokenizer). So ``failover up`` refuses such an interpreter, before anything starts,
naming the service and what to install. One short subprocess per distinct interpreter and
environment, in the working dir vLLM will have (the supervisor's): it finds packages without
importing them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from failover.config.schema import Config

PLUGIN = "failover_vllm.plugin:register"
_PROBE = ("import importlib.util, importlib.metadata as m, json; "
          "print(json.dumps({'vllm': importlib.util.find_spec('vllm') is not None, "
          "'plugins': [e.value for e in m.entry_points(group='vllm.general_plugins')]}))")
TIMEOUT = 60.0


def probe(python: str, env: dict[str, str]) -> dict | str:
    """What ``python`` (with ``env``) has: {"vllm": bool, "plugins": [...]}, or why it could not say."""
    try:
        out = subprocess.run([python, "-c", _PROBE], env=env, capture_output=True, text=True,
                             timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot be run ({e})"
    if out.returncode != 0:
        return f"exited with {out.returncode}: {out.stderr.strip()[-300:]}"
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"printed no answer: {out.stdout.strip()[-200:]!r}"


def check(config: Config) -> list[str]:
    """One problem per vLLM service whose interpreter lacks vLLM or failover's plugin."""
    problems, seen = [], {}
    for i, svc in enumerate(config.service):
        if svc.engine != "vllm":
            continue
        python = svc.engine_python or sys.executable
        key = (python, tuple(sorted(svc.engine_env.items())))
        if key not in seen:
            seen[key] = probe(python, dict(os.environ) | svc.engine_env)
        found = seen[key]
        where = f"service[{i}] ({svc.name}).engine_python"
        if isinstance(found, str):
            problems.append(f"{where}: {python} {found}")
        elif not found.get("vllm"):
            problems.append(f"{where}: {python} cannot import vllm; install vLLM there, or set engine_python "
                            "to the interpreter that has it")
        elif PLUGIN not in found.get("plugins", []):
            problems.append(f"{where}: failover is not installed in {python}'s environment, so vLLM there would "
                            "not load failover's plugin (weights = \"cache\" could not load, vLLM would outlive "
                            "a killed supervisor, a stream migrated inside a character would begin with its "
                            "prompt); install failover there as well (pip install failover)")
    return problems

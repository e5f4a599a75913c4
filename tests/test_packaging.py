"""What a user installs: the declared version, and a router that runs with no torch at all."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request

from conftest import REPO
from failover_common.ports import free_ports

# The engine extra's modules. A router-only install has none of them; here they are made
# unimportable (sys.modules[name] = None makes `import name` raise ImportError).
ENGINE_ONLY = ("torch", "safetensors", "tokenizers", "jinja2", "transformers")

BLOCKED = f"""
import sys
for name in {ENGINE_ONLY!r}:
    sys.modules[name] = None
from failover.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_version_is_pyprojects():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    res = subprocess.run([sys.executable, "-m", "failover", "--version"], capture_output=True, text=True,
                         timeout=30, cwd=REPO)
    assert res.returncode == 0 and res.stdout.strip() == f"failover {declared}"


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def test_router_and_admin_cli_run_without_torch(procs):
    port = free_ports(2)
    dead = port + 1  # free, nothing listens: the backend is down
    proc = procs.start([sys.executable, "-c", BLOCKED, "router", "--port", str(port),
                        "--backend", f"a=http://127.0.0.1:{dead}", "--probe-interval", "0.1"],
                       stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, f"the router died without torch: {proc.stderr.read()}"
        try:
            status, body = _get(f"http://127.0.0.1:{port}/health")
            break
        except OSError:
            assert time.monotonic() < deadline, "the router did not start within 20 s"
            time.sleep(0.1)
    assert status == 200 and body == {"alive": True}
    status, body = _get(f"http://127.0.0.1:{port}/ready")  # its only backend is down
    assert status == 503 and body["services"] == {"default": False}
    # the operator CLI needs no torch either; this router runs without an admin token
    res = subprocess.run([sys.executable, "-c", BLOCKED, "status", "--url", f"http://127.0.0.1:{port}"],
                         capture_output=True, text=True, timeout=30, cwd=REPO)
    assert res.returncode == 1 and "admin API disabled" in res.stderr, res.stderr
    assert "ImportError" not in res.stderr and "ModuleNotFoundError" not in res.stderr

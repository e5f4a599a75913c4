"""Helpers for the co-serving tests: a node with online and batch services, batch inputs, outputs."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from conftest import free_port
from supervisor_helpers import Node, _table, http


def batch_input(path: Path, n: int, *, max_tokens: int = 8, bad_lines: bool = True) -> list[str]:
    """``n`` greedy requests (completions and chat, both id forms) plus two bad lines; returns the
    ids every output must hold (bad lines included, under ``<file>:<line>``)."""
    lines, ids = [], []
    for i in range(n):
        if i % 4 == 3:
            lines.append(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"messages": [{"role": "user", "content": f"item {i}"}],
                                              "max_tokens": max_tokens, "temperature": 0}}))
        else:
            lines.append(json.dumps({"id": f"p{i}", "prompt": f"Item {i}: the quick brown fox",
                                     "max_tokens": max_tokens, "temperature": 0}))
        ids.append(f"c{i}" if i % 4 == 3 else f"p{i}")
        if bad_lines and i == 2:
            lines.append("{this is not json")
            ids.append(f"{path.name}:{len(lines)}")
        if bad_lines and i == 5:
            lines.append(json.dumps({"id": "no-prompt", "max_tokens": 3}))
            ids.append("no-prompt")
    path.write_text("".join(line + "\n" for line in lines))
    return ids


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def essence(record: dict) -> tuple:
    """What must be identical between two runs of one request (ids and timestamps are not)."""
    if record["error"] is not None:
        return ("error", record["error"]["message"], record["error"]["line"])
    resp = record["response"]
    body = resp["body"]
    if resp["status_code"] != 200:
        return (resp["status_code"], body.get("error", {}).get("message"))
    choices = tuple((c.get("text") if "text" in c else c["message"]["content"], tuple(c.get("token_ids") or ()),
                     c.get("finish_reason")) for c in body["choices"])
    return (200, choices, body["usage"]["completion_tokens"])


def node_config(path: Path, *, model: Path, run_dir: Path, services: list[dict], router: dict | None = None,
                supervisor: dict | None = None) -> Path:
    """A CPU node config with the given ``[[service]]`` tables (a ``batch`` key becomes [service.batch])."""
    text = f'run_dir = "{run_dir}"\n\n[model]\n' + _table(
        {"path": str(model), "dtype": "float32", "tp": 1, "device": "cpu", "transform": "none"})
    text += "\n[router]\n" + _table({"host": "127.0.0.1", "port": free_port(), "probe_interval": 0.1,
                                     "probe_timeout": 1.0, "probe_threshold": 3} | (router or {}))
    text += "\n[supervisor]\n" + _table({"ready_timeout": 60.0, "stop_timeout": 5.0, "drain_timeout": 5.0,
                                         "backoff_initial": 0.1} | (supervisor or {}))
    for svc in services:
        svc = dict(svc)
        batch = svc.pop("batch", None)
        svc.setdefault("port", free_port())
        text += "\n[[service]]\n" + _table(svc)
        if batch is not None:
            text += "\n[service.batch]\n" + _table(batch)
    path.write_text(text)
    return path


class CoNode(Node):
    """`failover up` on a co-serving config (online + batch services); ``stop()`` checks the cleanup."""

    def __init__(self, procs, tiny_model, run_dir, services: list[dict], **kw) -> None:
        config_path = node_config(Path(run_dir) / "node.toml", model=tiny_model, run_dir=Path(run_dir) / "node",
                                  services=services, **kw)
        self._launch(procs, Path(run_dir), config_path, ready_timeout=120)

    def batch(self, service: str) -> dict:
        return self.status()["supervisor"]["batch"][service]

    def admin(self, action: str, service: str) -> dict:
        code, doc = http("POST", f"{self.url}/admin/{action}", {"service": service}, token=self.token)
        assert code == 200, doc
        return doc

    def events(self, name: str) -> list[dict]:
        out = []
        for line in self.log().splitlines():
            if f'"{name}"' in line and line.startswith("{"):
                doc = json.loads(line)
                if doc.get("event") == name:
                    out.append(doc)
        return out


class Burst:
    """``n`` concurrent online requests at once (a load spike); failures are collected."""

    def __init__(self, url: str, n: int, max_tokens: int = 24) -> None:
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._one, args=(url, i, max_tokens), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _one(self, url: str, i: int, max_tokens: int) -> None:
        body = {"model": "chat", "prompt": f"spike {i}", "max_tokens": max_tokens, "temperature": 0}
        try:
            code, doc = http("POST", url + "/v1/completions", body, timeout=60)
            if code != 200 or not doc.get("choices"):
                self.failures.append(f"{code}: {str(doc)[:200]}")
        except OSError as e:
            self.failures.append(f"{type(e).__name__}: {e}")

    def join(self) -> list[str]:
        for t in self.threads:
            t.join(90)
        return self.failures

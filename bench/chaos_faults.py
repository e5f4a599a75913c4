"""The chaos soak's faults: a seeded schedule, and the injectors (signals and garbage).

Every random choice (gap to the next fault, its kind, a freeze's pause, the order of garbage
variants) comes from one ``random.Random(seed)`` in a fixed order, so a seed names one schedule.
Targets are resolved from the node's own status document (``GET /admin/status``) at the moment of
the fault, and a pid is signalled only if it carries the run's marker (never a stranger's process
that happens to reuse a pid).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import struct
from dataclasses import dataclass, field

import aiohttp
import msgspec

from chaos_node import SERVICE, is_ours, start_time

SIGNAL_TARGETS = ("primary", "standby", "zygote", "daemon")
KINDS = tuple(f"{how}:{who}" for who in SIGNAL_TARGETS for how in ("kill", "freeze")) + (
    "garbage:daemon", "garbage:admin")
BATCH_KINDS = ("kill:batch", "freeze:batch")
DAEMON_VARIANTS = ("random_bytes", "truncated_frame", "oversized_length", "bad_msgpack", "unknown_type")
ADMIN_VARIANTS = ("no_token", "wrong_token", "wrong_token_drain", "malformed_json", "unknown_instance",
                  "unknown_service", "http_garbage")


@dataclass
class Fault:
    kind: str
    at: float  # monotonic: the signal, or the first garbage byte
    pid: int | None = None
    pause_s: float = 0.0  # freeze: SIGSTOP .. SIGCONT
    detail: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # the fault did not meet the expectation
    recovered_s: float | None = None  # from the fault until the node was whole again

    @property
    def target(self) -> str:
        return self.kind.split(":", 1)[1]

    def as_json(self, t0: float) -> dict:
        return {"kind": self.kind, "t": round(self.at - t0, 3), "pid": self.pid, "pause_s": round(self.pause_s, 3),
                "recovered_s": None if self.recovered_s is None else round(self.recovered_s, 3),
                "detail": self.detail, "problems": self.problems}


class Schedule:
    """When the next fault comes, what it is, and how long a freeze lasts."""

    def __init__(self, seed: int, rate_per_min: float, batch: bool, only: tuple[str, ...] = ()) -> None:
        self.rng = random.Random(seed)
        self.mean_gap = 60.0 / rate_per_min
        self.kinds = only or KINDS + (BATCH_KINDS if batch else ())
        self.deck = self.shuffled(self.kinds)  # the first faults cover every kind once, in seeded order

    def gap(self) -> float:
        return self.mean_gap * self.rng.uniform(0.5, 1.5)

    def kind(self) -> str:
        return self.deck.pop() if self.deck else self.rng.choice(self.kinds)

    def pause(self) -> float:
        return self.rng.uniform(0.5, 3.0)

    def shuffled(self, variants: tuple[str, ...]) -> list[str]:
        out = list(variants)
        self.rng.shuffle(out)
        return out


# -- reading the status document ---------------------------------------------------------------
def service_doc(doc: dict, name: str = SERVICE) -> dict:
    return next(s for s in doc["services"] if s["name"] == name)


def target_pid(doc: dict, target: str) -> int | None:
    sup = doc["supervisor"]
    if target == "zygote":
        return sup["zygote"]["pid"]
    if target == "daemon":
        return sup["daemon"]["pid"]
    if target == "batch":
        return next((s["pid"] for s in sup["slots"] if s["slot"].startswith("batch-") and s["pid"]), None)
    for inst in service_doc(doc)["instances"]:
        if inst["role"] == target and inst["ready"]:
            return inst["pid"]
    return None


def whole(doc: dict) -> bool:
    """The node is back to full strength: a ready primary and standby, every slot running, daemon
    ready, zygote up, no failed service."""
    sup = doc["supervisor"]
    if sup["failed"] or not sup["daemon"]["ready"] or not sup["daemon"]["pid"] or not sup["zygote"]["pid"]:
        return False
    if any(s["state"] != "running" or not s["pid"] for s in sup["slots"] if not s["hold"]):
        return False
    svc = service_doc(doc)
    roles = sorted(i["role"] for i in svc["instances"] if i["ready"] and not i["suspect"])
    return bool(svc["ready"]) and roles == ["primary", "standby"]


# -- signals -----------------------------------------------------------------------------------
async def signal_fault(fault: Fault, marker: str) -> None:
    """SIGKILL, or SIGSTOP then SIGCONT after ``fault.pause_s`` (only if it is still the same process)."""
    pid = fault.pid
    assert pid is not None
    if not is_ours(pid, marker):
        fault.problems.append(f"pid {pid} is not a process of this node; not signalled")
        return
    born = start_time(pid)
    if fault.kind.startswith("kill:"):
        os.kill(pid, signal.SIGKILL)
        return
    os.kill(pid, signal.SIGSTOP)
    await asyncio.sleep(fault.pause_s)
    if start_time(pid) == born:
        os.kill(pid, signal.SIGCONT)
        fault.detail["continued"] = True
    else:
        fault.detail["continued"] = False  # fenced (SIGKILLed) while frozen: nothing to continue


# -- garbage to the daemon's socket ------------------------------------------------------------
def _frame(body: bytes) -> bytes:
    return struct.pack("!I", len(body)) + body


def daemon_garbage(path: str, variant: str, rng: random.Random) -> str:
    """One connection of garbage; returns what the daemon did (answered, closed, said nothing)."""
    payload = {
        "random_bytes": lambda: rng.randbytes(rng.randint(1, 4096)),
        "truncated_frame": lambda: struct.pack("!I", 4096) + rng.randbytes(100),
        "oversized_length": lambda: struct.pack("!I", 0xFFFFFFF0) + b"\x80",
        "bad_msgpack": lambda: _frame(b"\xc1" * 16),  # 0xc1 is never used in msgpack
        "unknown_type": lambda: _frame(msgspec.msgpack.encode({"type": "no-such-message", "x": 1})),
    }[variant]()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        s.connect(path)
        try:
            s.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            return "closed before all was sent"
        if variant == "truncated_frame":
            return "hung up mid-frame"  # we close with the frame unfinished
        got = b""
        try:
            while len(got) < 1 << 16:
                chunk = s.recv(4096)
                if not chunk:
                    return f"answered {len(got)} bytes and closed" if got else "closed"
                got += chunk
                if len(got) >= 4 and len(got) >= 4 + struct.unpack("!I", got[:4])[0]:
                    return "answered (connection kept)"
        except socket.timeout:
            return f"answered {len(got)} bytes, then silence" if got else "silence (waits for more)"
        except ConnectionResetError:
            return "reset"
    return "answered"


# -- garbage to the admin API ------------------------------------------------------------------
async def admin_garbage(session: aiohttp.ClientSession, url: str, token: str, variant: str,
                        rng: random.Random) -> tuple[str, bool]:
    """One bad admin call; returns (what came back, whether that is what the docs promise)."""
    good = {"Authorization": f"Bearer {token}"}
    bad = {"Authorization": "Bearer " + "0" * len(token)}
    if variant == "http_garbage":
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        try:
            writer.write(rng.randbytes(512) + b"\r\n\r\n")
            await writer.drain()
            head = await asyncio.wait_for(reader.read(64), 5.0)
        except (ConnectionError, asyncio.TimeoutError) as e:
            return type(e).__name__, True
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError:
                pass
        text = head.decode(errors="replace").split("\r\n", 1)[0]
        return text or "closed", not head or head[:10] in (b"HTTP/1.0 4", b"HTTP/1.1 4")
    method, path, body, headers, expect = {
        "no_token": ("GET", "/admin/status", None, {}, 401),
        "wrong_token": ("GET", "/admin/status", None, bad, 401),
        "wrong_token_drain": ("POST", "/admin/drain", json.dumps({"instance": f"{SERVICE}-0"}), bad, 401),
        "malformed_json": ("POST", "/admin/promote", '{"service": "' + SERVICE, good, 400),
        "unknown_instance": ("POST", "/admin/drain", json.dumps({"instance": "ghost-9"}), good, 404),
        "unknown_service": ("POST", "/admin/promote", json.dumps({"service": "ghost"}), good, 404),
    }[variant]
    headers = headers | {"Content-Type": "application/json"}
    async with session.request(method, url + path, data=body, headers=headers) as r:
        text = await r.text()
        try:
            shaped = isinstance(json.loads(text).get("error"), dict)
        except (json.JSONDecodeError, AttributeError):
            shaped = False
        return f"{r.status}", r.status == expect and shaped

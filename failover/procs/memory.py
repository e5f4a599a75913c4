"""Free memory and who holds the GPU, for the supervisor: /proc/meminfo and nvidia-smi, never a CUDA
context (the supervisor creates none).

Every function returns None where it cannot tell (no nvidia-smi on a CPU node, a failed query).
"""

from __future__ import annotations

import shutil
import subprocess


def query(what: str, timeout: float = 10.0) -> list[str] | None:
    """The lines of ``nvidia-smi --query-WHAT --format=csv,noheader,nounits``."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, f"--query-{what}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_free_bytes() -> int | None:
    """Free memory of the emptiest GPU."""
    lines = query("gpu=memory.free")
    values = [int(v) for v in lines or [] if v.isdigit()]
    return min(values) << 20 if values else None


def gpu_pids() -> set[int] | None:
    """Pids holding a CUDA context."""
    lines = query("compute-apps=pid", timeout=5.0)
    return None if lines is None else {int(v) for v in lines if v.isdigit()}


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def free_bytes(device: str) -> int | None:
    """Memory a new instance on ``device`` ("cpu" or "cuda") can take."""
    return mem_available() if device == "cpu" else gpu_free_bytes()

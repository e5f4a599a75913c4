"""GPU facts for the supervisor, from nvidia-smi: the supervisor never creates a CUDA context.

Every function returns None where there is no nvidia-smi to ask (a CPU node) or it fails.
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

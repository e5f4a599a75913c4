"""The daemon's configuration: one frozen dataclass, built and checked by ``cli.py``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .protocol import MAX_FRAME

SOCKET_NAME = "daemon.sock"
READY_NAME = "daemon.ready"


def default_run_dir() -> Path:
    return Path(f"/tmp/failover-{os.getuid()}")


@dataclass(frozen=True, slots=True)
class DaemonSettings:
    model: Path
    dtype: str  # resolved (never "auto")
    tp: int = 1
    device: str = "cpu"  # "cpu" | "cuda"
    transform: str = "none"
    run_dir: Path = field(default_factory=default_run_dir)
    force: bool = False
    client_timeout: float = 10.0  # seconds a client may stay silent before it has attached
    frame_timeout: float = 5.0  # seconds from a frame's first byte to its last, attached or not
    max_buffered: int = 256 << 20  # bytes of partly received frames, all connections together
    allow_uids: frozenset[int] = frozenset()  # peers allowed besides the daemon's own uid
    chunk_bytes: int = 0  # CUDA: split an arena into chunks of at most this many bytes (0: one)
    die_with_parent: bool = False
    log_level: str = "info"
    progress: str = "auto"  # the load's progress: bar (a terminal), events (structlog), off, auto
    # "failover": the reference engine's layout (cache_daemon.loader); "vllm": vLLM's own loading,
    # run by failover_vllm.pack under engine_python with engine_args (vLLM's flags that decide the bytes)
    engine: str = "failover"
    engine_python: str = ""  # the interpreter that has vllm (default: the daemon's own)
    engine_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.progress not in ("auto", "bar", "events", "off"):
            raise ValueError(f"--progress must be auto, bar, events or off, not {self.progress!r}")
        if self.engine not in ("failover", "vllm"):
            raise ValueError(f"--engine must be failover or vllm, not {self.engine!r}")
        if self.engine == "vllm" and self.transform != "none":
            raise ValueError("--transform is the reference engine's; vLLM quantizes by its own flags "
                             "(--engine-arg=--quantization=...)")
        if self.tp < 1:
            raise ValueError(f"--tp must be at least 1, not {self.tp}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, not {self.device!r}")
        if self.client_timeout <= 0:
            raise ValueError("--client-timeout must be positive")
        if self.frame_timeout <= 0:
            raise ValueError("--frame-timeout must be positive")
        if self.max_buffered < MAX_FRAME:
            raise ValueError(f"--max-buffered-mib must be at least {MAX_FRAME >> 20} (one frame of the largest size)")
        if len(str(self.socket_path)) > 107:
            raise ValueError(f"socket path {self.socket_path} is too long for AF_UNIX: use a shorter --run-dir")

    @property
    def socket_path(self) -> Path:
        return self.run_dir / SOCKET_NAME

    @property
    def ready_path(self) -> Path:
        return self.run_dir / READY_NAME

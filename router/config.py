"""Router configuration: one frozen dataclass, validated where it is built.

The CLI (``router/cli.py``) and the supervisor each build their own copy; no router module reads
the environment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# What the router forwards: the OpenAI paths our engine serves. Anything else (other paths, dot
# segments, percent-encoded characters, a trailing slash) gets the router's own 404, so no request
# can reach an engine endpoint such as /admin/kv through it.
FORWARD_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
_SAFE_PATH = re.compile(r"^/v1(/[A-Za-z0-9_-]+)+$")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"  # loopback by default: the admin API rides on the same listener
    port: int = 8000  # 0 picks a free port; Router.port tells which
    admin_token_file: Path | None = None  # None disables /admin/ (403 with a hint)
    probe_path: str = "/ready"
    probe_interval: float = 0.1  # a new probe every interval, even while older ones are pending
    probe_timeout: float = 0.25
    failure_threshold: int = 2  # consecutive failures (probes and passive observations) -> failed
    queue_size: int = 256  # requests that may wait per service while no primary is ready
    queue_deadline: float = 10.0  # how long one of them waits before 503 + Retry-After
    max_retries: int = 4  # re-sends of a request that sent no byte to the client yet
    max_migrations: int = 3  # re-issues of a stream that already sent tokens
    max_body_bytes: int = 16 * 1024 * 1024  # one request body, as sent and once decompressed
    max_buffered_bytes: int = 256 * 1024 * 1024  # all request bodies held at once; beyond: 503
    body_timeout: float = 15.0  # the whole request body must arrive within this (else 408, closed)
    forward_paths: tuple[str, ...] = FORWARD_PATHS  # exact raw paths forwarded; all else is 404
    connect_timeout: float = 1.0  # a connect that times out is "slow" (a full backlog), not a failure
    max_upstream: int = 128  # requests in flight to one instance at once (aiohttp's listen backlog is 128)
    upstream_queue_size: int = 1024  # requests that may wait in the router for one of those slots
    loop_lag_tolerance: float = 0.1  # a probe that timed out while our own loop lagged more is not counted
    # Hang under load (router/stall.py, health.py): every stream of the primary silent past
    # max(floor, factor x its recent inter-read gap) and a probe unanswered this long -> failed at once.
    hang_probe_timeout: float = 0.1  # 0: off (probes alone decide, after probe_timeout x failure_threshold)
    hang_stream_floor: float = 0.15
    hang_stream_factor: float = 4.0
    replace_settle_timeout: float = 2.0  # after a failover, wait (at most this) for the requests it broke
    #                                      to resume before asking for a replacement (0: ask at once)
    stall_timeout: float = 30.0  # no upstream chunk for this long mid-stream: the backend failed
    drain_timeout: float = 30.0  # planned switchover / drain: wait this long for in-flight requests
    fence_timeout: float = 10.0  # Launcher.fence may take this long before we log and move on
    shutdown_timeout: float = 5.0  # stop(): in-flight requests get this long to finish
    reuse_port: bool = False  # SO_REUSEPORT: one of N router workers on one port (failover router --workers)

    def __post_init__(self) -> None:
        positive = ("probe_interval", "probe_timeout", "queue_deadline", "connect_timeout",
                    "stall_timeout", "body_timeout", "drain_timeout", "fence_timeout", "shutdown_timeout")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"RouterConfig.{name} must be > 0, not {getattr(self, name)!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"RouterConfig.port must be 0..65535, not {self.port}")
        if self.failure_threshold < 1:
            raise ValueError("RouterConfig.failure_threshold must be at least 1")
        if self.max_upstream < 1:
            raise ValueError("RouterConfig.max_upstream must be at least 1")
        if self.hang_probe_timeout < 0 or self.hang_stream_floor <= 0 or self.hang_stream_factor < 1:
            raise ValueError("RouterConfig.hang_probe_timeout must be >= 0 (0: off), hang_stream_floor > 0 "
                             "and hang_stream_factor >= 1")
        if self.loop_lag_tolerance <= 0 or self.replace_settle_timeout < 0:
            raise ValueError("RouterConfig.loop_lag_tolerance must be > 0 and replace_settle_timeout >= 0")
        for name in ("queue_size", "upstream_queue_size", "max_retries", "max_migrations"):
            if getattr(self, name) < 0:
                raise ValueError(f"RouterConfig.{name} must be >= 0")
        if self.max_body_bytes < 1024:
            raise ValueError("RouterConfig.max_body_bytes must be at least 1024")
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError(f"RouterConfig.max_buffered_bytes ({self.max_buffered_bytes}) must be at "
                             f"least max_body_bytes ({self.max_body_bytes})")
        bad = [p for p in self.forward_paths if not _SAFE_PATH.match(p)]
        if bad or not self.forward_paths:
            raise ValueError(f"RouterConfig.forward_paths must be /v1/... paths of letters, digits, '-' "
                             f"and '_' segments, not {bad or 'empty'}")
        if not self.probe_path.startswith("/"):
            raise ValueError(f"RouterConfig.probe_path must start with '/', not {self.probe_path!r}")

    @property
    def retry_after_s(self) -> int:
        """Retry-After for a 503: a failover normally completes well within a second."""
        return max(1, round(self.probe_timeout * self.failure_threshold + self.probe_interval))

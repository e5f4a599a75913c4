"""Progress of a long load, for a person or for a log: one bar redrawn in place on a terminal, the
same fields as structured events otherwise (``load_progress`` with bytes, total, gbps, eta_s).

    bar = LoadBar("cache daemon loading", sys.stderr, mode="auto")
    bar.update(done_bytes, total_bytes, seconds)    # as often as you like; throttled here
    bar.finish(total_bytes, seconds)

Used by the cache daemon (``failover daemon``) and by the supervisor of ``failover up``.
"""

from __future__ import annotations

import time
from typing import TextIO

import structlog

log = structlog.get_logger(__name__)

MODES = ("auto", "bar", "events", "off")
BAR_EVERY_S = 0.1  # terminal redraws
EVENT_EVERY_S = 2.0  # structured events
WIDTH = 28


def rate_eta(done: int, total: int, seconds: float) -> tuple[float | None, float | None]:
    """(GB/s so far, seconds left at that rate); None where not known yet."""
    if seconds <= 0 or done <= 0:
        return None, None
    rate = done / seconds
    return rate / 1e9, max(total - done, 0) / rate


def bar_line(label: str, done: int, total: int, seconds: float) -> str:
    """``label [##########..........] 3.21/8.00 GB  2.10 GB/s  ETA 2.3s``"""
    fraction = min(done / total, 1.0) if total > 0 else 0.0
    filled = int(WIDTH * fraction)
    gbps, eta = rate_eta(done, total, seconds)
    return (f"{label} [{'#' * filled}{'.' * (WIDTH - filled)}] {done / 1e9:.2f}/{total / 1e9:.2f} GB "
            f"{fraction * 100:5.1f}%  {'-' if gbps is None else f'{gbps:.2f}'} GB/s  "
            f"ETA {'-' if eta is None else _seconds(eta)}")


def _seconds(s: float) -> str:
    return f"{s:.1f}s" if s < 60 else f"{int(s) // 60}m{int(s) % 60:02d}s"


class LoadBar:
    """``mode``: ``bar`` (redraw one line of ``stream``), ``events`` (structlog), ``off``, or
    ``auto`` (bar when ``stream`` is a terminal, else events)."""

    def __init__(self, label: str, stream: TextIO, mode: str = "auto", **fields: object) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {MODES}, not {mode!r}")
        if mode == "auto":
            mode = "bar" if stream.isatty() else "events"
        self.label, self.stream, self.mode, self.fields = label, stream, mode, fields
        self._last = float("-inf")
        self._drawn = False

    def update(self, done: int, total: int, seconds: float) -> None:
        now = time.monotonic()
        if self.mode == "off" or now - self._last < (BAR_EVERY_S if self.mode == "bar" else EVENT_EVERY_S):
            return
        self._last = now
        if self.mode == "bar":
            self.stream.write("\r" + bar_line(self.label, done, total, seconds) + "\x1b[K")
            self.stream.flush()
            self._drawn = True
        else:
            gbps, eta = rate_eta(done, total, seconds)
            log.info("load_progress", bytes=done, total=total, seconds=round(seconds, 2),
                     gbps=None if gbps is None else round(gbps, 3), eta_s=None if eta is None else round(eta, 1),
                     **self.fields)

    def finish(self, total: int, seconds: float) -> None:
        """The load is done: the bar's last state, then a newline (events: one ``load_done``)."""
        if self.mode == "bar":
            self.stream.write("\r" + bar_line(self.label, total, total, seconds) + "\x1b[K\n")
            self.stream.flush()
        elif self.mode == "events":
            gbps, _ = rate_eta(total, total, seconds)
            log.info("load_done", bytes=total, seconds=round(seconds, 3),
                     gbps=None if gbps is None else round(gbps, 3), **self.fields)
        self.mode = "off"  # once

    def abandon(self) -> None:
        """The load failed or was cancelled: end the bar's line so the error starts on its own."""
        if self.mode == "bar" and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        self.mode = "off"

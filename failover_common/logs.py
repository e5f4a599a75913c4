"""Logging setup shared by every process of the project.

The one structlog configuration, in the leaf package so that every package (the router included)
uses it without importing another; libraries only call ``structlog.get_logger(__name__)`` and the
process entry points call :func:`configure_logging` once.
"""

from __future__ import annotations

import logging
import sys

import structlog


class _Stderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write.

    Binding the stream at configure time breaks when it is replaced later (pytest's capture, a
    daemonised process): the logger would keep writing to a closed file.
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info", *, json: bool | None = None, process: str = "") -> None:
    """Configure structlog for this process: console on a terminal, JSON lines otherwise.

    ``process`` is bound into every event so interleaved logs of a node stay readable.
    Logs go to stderr; stdout stays free for a command's own output.
    """
    if json is None:
        json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.reset_defaults()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.WriteLoggerFactory(_Stderr()),  # one write per event line: atomic on a shared pipe
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if process:
        structlog.contextvars.bind_contextvars(process=process)

"""The event loop the router runs on: uvloop when it is installed (``pip install failover[fast]``),
asyncio's own otherwise. ``bench/vs_haproxy.py --loop`` measures both.

    from router import evloop
    evloop.run(main(), kind="auto")     # "auto" | "uvloop" | "asyncio"
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

KINDS = ("auto", "uvloop", "asyncio")


def factory(kind: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A loop factory for ``asyncio.Runner`` (None: asyncio's default). ``uvloop`` when it is not
    installed is an error that says how to get it; ``auto`` then falls back quietly."""
    if kind not in KINDS:
        raise ValueError(f"event loop must be one of {KINDS}, not {kind!r}")
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if kind == "uvloop":
            raise RuntimeError("uvloop is not installed: pip install 'failover[fast]' (or uvloop), "
                               "or run with --loop asyncio") from exc
        return None
    return uvloop.new_event_loop


def name(kind: str = "auto") -> str:
    """Which loop ``kind`` gives here: "uvloop" or "asyncio"."""
    return "asyncio" if factory(kind) is None else "uvloop"


def run(main: Coroutine[Any, Any, Any], kind: str = "auto") -> Any:
    with asyncio.Runner(loop_factory=factory(kind)) as runner:
        return runner.run(main)

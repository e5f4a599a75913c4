"""Helpers for the supervisor-side tests (zygote targets, config writers, process invariants)."""

from __future__ import annotations

import time


def child_main(argv: list[str]) -> int:
    """A zygote target for tests: sleep ``argv[1]`` seconds (default 0), exit with code ``argv[0]``."""
    if len(argv) > 1:
        time.sleep(float(argv[1]))
    return int(argv[0]) if argv else 0

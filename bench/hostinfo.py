"""What a bench's header says of the machine it ran on, so figures from two machines are read apart."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` is empty on most Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpus() -> str:
    """``cpu="MODEL" cores=N``: the header's part that says how fast one core is and how many there are."""
    return f'cpu="{cpu_model()}" cores={os.cpu_count()}'

"""The one size grammar of the project: config files (``kv_memory = "256MiB"``) and command lines
(``--kv-memory 256MiB``) read sizes here.

A size is a whole number of bytes, or a number with a unit. ``KiB``, ``MiB``, ``GiB``, ``TiB`` are
binary (2**10, 2**20, ...); ``KB``, ``MB``, ``GB``, ``TB`` are decimal (10**3, 10**6, ...); ``B`` is
bytes. Units are case-insensitive. A bare ``K``, ``M`` or ``G`` is refused: it is read as binary by
some tools and as decimal by others, so the unit must say which.
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | str) -> int:
    """``268435456``, ``"256MiB"``, ``"1.5GB"`` -> bytes; ValueError that says what is allowed."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not a size; use bytes or a number with B, KiB, MiB, GiB (or KB, MB, GB)")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must not be negative")
        return value
    m = _SIZE.match(value)
    unit = m.group(2).lower() if m else ""
    if m and unit in ("k", "m", "g", "t"):
        raise ValueError(f"{value!r}: a bare {m.group(2)} is ambiguous; write {m.group(1)}{m.group(2).upper()}iB "
                         f"(binary, 2**10 steps) or {m.group(1)}{m.group(2).upper()}B (decimal, 10**3 steps)")
    if not m or unit not in _UNITS:
        raise ValueError(f"{value!r} is not a size; use bytes or a number with B, KiB, MiB, GiB (or KB, MB, GB)")
    return int(float(m.group(1)) * _UNITS[unit])

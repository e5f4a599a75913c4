"""Memory of a process tree from /proc/PID/smaps: how much of it is the cache daemon's arenas, and
whether those pages are shared with other processes or private to this tree.

``Rss`` counts every resident page a process maps; ``Pss`` divides each page by the number of
processes that map it. For an arena mapped by N instances, Pss is about Rss / N and the pages are
``Shared_Clean``; a private copy of the weights would be ``Private_*`` at Pss = Rss.
CPU arenas are memfds (``/memfd:failover-arena:... (deleted)``); CUDA arenas (VMM) are device memory
and do not show here.
"""

from __future__ import annotations

ARENA_TAG = "failover-arena"
FIELDS = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty")


def _add(into: dict[str, int], line: str) -> None:
    key, _, rest = line.partition(":")
    if key in FIELDS:
        into[key] = into.get(key, 0) + int(rest.split()[0]) * 1024


def tree_memory(pids) -> dict[str, dict[str, int]]:
    """Bytes per field for ``pids`` together: ``arena`` (mappings of the daemon's arenas) and
    ``total`` (every mapping). Processes that are gone are skipped."""
    arena: dict[str, int] = dict.fromkeys(FIELDS, 0)
    total: dict[str, int] = dict.fromkeys(FIELDS, 0)
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps") as f:
                lines = f.readlines()
        except OSError:
            continue
        in_arena = False
        for line in lines:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's header line: "start-end perms ..."
                in_arena = ARENA_TAG in line
                continue
            _add(total, line)
            if in_arena:
                _add(arena, line)
    return {"arena": arena, "total": total}

"""The rules of a batch service's ``[service.batch]`` table, and which online services it watches.

Split out of ``failover.config.schema`` (which calls ``check_batch`` from ``parse_config``); ``svc``
is a ``ServiceConfig``, ``services`` the node's list of them.
"""

from __future__ import annotations


def check_batch(key: str, svc, services: list) -> list[str]:
    b = svc.batch
    assert b is not None
    problems = []
    if svc.kind != "batch":
        problems.append(f"{key}: only a service with kind = \"batch\" takes [service.batch]")
    if b.queue_low >= b.queue_high:
        problems.append(f"{key}.queue_low: {b.queue_low} must be below queue_high ({b.queue_high})")
    if b.ttft_low >= b.ttft_high:
        problems.append(f"{key}.ttft_low: {b.ttft_low} must be below ttft_high ({b.ttft_high})")
    online = {s.name for s in services if s.kind == "online"}
    for name in b.watch or []:
        if name not in online:
            problems.append(f"{key}.watch: {name!r} is not an online service; online: {sorted(online)}")
    try:
        b.memory_margin_bytes
    except ValueError as e:
        problems.append(f"{key}.memory_margin: {e}")
    if not 0 <= b.output_mode <= 0o777 or b.output_mode & 0o600 != 0o600 or b.output_mode & 0o022:
        problems.append(f"{key}.output_mode: {b.output_mode:#o} must let us read and write (0o600) and nobody "
                        "else write; e.g. 0o600 (the default) or 0o640 (TOML octal: 0o640)")
    if svc.command is not None:
        problems.append(f"{key}: a batch service runs a managed engine (ours or engine = \"vllm\"); remove command")
    return problems


def watched_services(svc, services: list) -> list[str]:
    """The online services whose load preempts batch service ``svc``."""
    assert svc.batch is not None
    if svc.batch.watch is not None:
        return list(svc.batch.watch)
    return [s.name for s in services if s.kind == "online" and s.priority > svc.priority]

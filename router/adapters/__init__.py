"""Engine-kind adapters of the router: what differs between engines when a stream is migrated.

An adapter knows one engine kind's liveness path and how to continue its streams exactly; the
relay (router/stream.py) owns the SSE framing, the client's bytes and the ids already sent, and asks
the adapter's per-stream object (``adapter.stream(payload, path)``) for: the first attempt's body,
what one event carries, the event as the client asked for it, the continuation's path and body,
and a continuation's events rewritten for the client. ``None`` is the bundled engine, whose
migration the relay does itself (``resume_token_ids``). SGLang would be one more module here.
"""

from __future__ import annotations

from router.adapters.vllm import VllmAdapter

ADAPTERS = {"vllm": VllmAdapter()}
ENGINES = ("failover", *ADAPTERS)


def adapter_for(engine: str) -> VllmAdapter | None:
    """The adapter of engine kind ``engine`` (None: the bundled engine's built-in migration)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine kind {engine!r}; known: {', '.join(ENGINES)}")
    return ADAPTERS.get(engine)

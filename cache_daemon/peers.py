"""Who may talk to the daemon: the peer's uid from SO_PEERCRED, checked against a policy."""

from __future__ import annotations

from failover_common.peercred import peer_credentials

__all__ = ["peer_allowed", "peer_credentials"]


def peer_allowed(uid: int, *, daemon_uid: int, allow_uids: frozenset[int] = frozenset()) -> bool:
    """Same uid as the daemon, or explicitly allowed. Root gets no exception: list uid 0 to allow it."""
    return uid == daemon_uid or uid in allow_uids

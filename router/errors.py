"""Typed errors at the router's edges."""

from __future__ import annotations


class RouterError(Exception):
    """Base of the router's own errors."""


class NoPrimary(RouterError):
    """No ready primary for the service within the queue deadline (or the queue is full)."""

    def __init__(self, service: str, why: str) -> None:
        super().__init__(f"service {service!r} has no ready primary: {why}")
        self.service = service
        self.why = why


class Saturated(RouterError):
    """The instance has ``max_upstream`` requests in flight and its wait queue is full (or the wait
    ran past the queue deadline): overload, answered 503 + Retry-After, never counted against it."""

    def __init__(self, instance: str, why: str) -> None:
        super().__init__(f"instance {instance} is saturated: {why}")
        self.instance = instance
        self.why = why


class BackendFailed(RouterError):
    """One upstream attempt failed. ``kind`` says how, which decides what the health side does:

    connect / reset / unavailable: suspicion, an immediate confirm probe (refused, reset: dead);
    slow: the connect timed out (a full listen backlog: saturated, not dead): retried, not counted;
    garbage / stall: the backend is failed outright (it answered, but not as an engine does);
    fenced: the instance was fenced while the request was in flight (already handled).
    """

    def __init__(self, instance: str, kind: str, detail: str) -> None:
        super().__init__(f"backend {instance} failed ({kind}): {detail}")
        self.instance = instance
        self.kind = kind
        self.detail = detail


class AdminError(RouterError):
    """An admin request that cannot be done; carries the HTTP status and error type."""

    def __init__(self, status: int, message: str, type_: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_


class BodyRejected(RouterError):
    """A request body the router will not forward (too slow, too large, too many at once, badly
    encoded); carries the HTTP status and the OpenAI error type."""

    def __init__(self, status: int, message: str, type_: str) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_

"""router/upstream.py's errors, which router/proxy.py maps to failure kinds (router/errors.py)."""


class ConnectError(OSError):
    """The TCP connect failed (refused, unreachable)."""


class ConnectTimeout(TimeoutError):
    """The TCP connect did not complete within the pool's connect timeout."""


class ProtocolError(Exception):
    """The engine's answer is not HTTP/1.1 as we can parse it."""


class ResetError(ConnectionResetError):
    """The connection ended before the response did."""


class PoolClosed(RuntimeError):
    """The pool was closed (its instance fenced or the router stopping)."""


__all__ = ["ConnectError", "ConnectTimeout", "PoolClosed", "ProtocolError", "ResetError"]

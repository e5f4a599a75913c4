"""The bearer token that guards the engine's state-changing endpoints (``POST /admin/kv``).

The supervisor writes a fresh token to ``RUN_DIR/engine.token`` (0600) for each run and passes it
with ``--admin-token-file``; only the supervisor, which holds that file, may change an engine. The
file is read once at startup with the same checks as the router's token (failover_common.tokens).
An engine started without one refuses every admin call (403): it is never open.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from engine.config import ConfigError
from engine.protocol import ApiError
from failover_common import tokens


def read_token(path: Path) -> bytes:
    """The token in ``path``; ConfigError, saying how to fix it, for a file that cannot be trusted."""
    try:
        return tokens.read_token(path)
    except tokens.TokenFileError as e:
        raise ConfigError(f"--admin-token-file: {e}") from e


def check(request: web.Request, token: bytes | None) -> None:
    """Raise ApiError unless ``request`` carries ``Authorization: Bearer <token>``."""
    if token is None:
        raise ApiError(403, "admin calls are disabled: start the engine with --admin-token-file",
                       type="permission_error", code="admin_disabled")
    if not tokens.bearer_matches(request.headers.get("Authorization", ""), token):
        raise ApiError(401, "missing or wrong bearer token", type="authentication_error",
                       code="unauthorized")

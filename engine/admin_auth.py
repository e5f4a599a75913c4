"""The bearer token that guards the engine's state-changing endpoints (``POST /admin/kv``).

The supervisor writes a fresh token to ``RUN_DIR/engine.token`` (0600) for each run and passes it
with ``--admin-token-file``; only the supervisor, which holds that file, may change an engine. The
file is read once at startup and must be a regular file owned by this user with no group or other
access bits. An engine started without one refuses every admin call (403): it is never open.
"""

from __future__ import annotations

import hmac
import os
import stat
from pathlib import Path

from aiohttp import web

from engine.config import ConfigError
from engine.protocol import ApiError


def read_token(path: Path) -> bytes:
    """The token in ``path``; ConfigError, saying how to fix it, for a file that cannot be trusted."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"--admin-token-file {path}: {e.strerror}; create it with a random token "
                          "and chmod 600") from e
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"--admin-token-file {path} is not a regular file")
    if st.st_uid != os.getuid():
        raise ConfigError(f"--admin-token-file {path} is owned by uid {st.st_uid}, not this user "
                          f"({os.getuid()}); chown it or write a new one")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"--admin-token-file {path} is open to others (mode {stat.S_IMODE(st.st_mode):o}); "
                          f"run: chmod 600 {path}")
    token = path.read_bytes().strip()
    if not token:
        raise ConfigError(f"--admin-token-file {path} is empty; put a random token in it")
    return token


def check(request: web.Request, token: bytes | None) -> None:
    """Raise ApiError unless ``request`` carries ``Authorization: Bearer <token>``."""
    if token is None:
        raise ApiError(403, "admin calls are disabled: start the engine with --admin-token-file",
                       type="permission_error", code="admin_disabled")
    auth = request.headers.get("Authorization", "")
    given = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
    if not hmac.compare_digest(given, token):
        raise ApiError(401, "missing or wrong bearer token", type="authentication_error",
                       code="unauthorized")

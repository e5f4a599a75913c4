"""The node's run dir: made private, holding the supervisor's pid file and the admin tokens, and left
empty at a clean stop.

Ownership: the supervisor owns the pid file, the engines' admin token (``engine.token``: only it and
the engines it starts read it) and, when it generated it, the router's admin token; the daemon owns
its socket and ready file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import structlog

from cache_daemon import owned
from failover.config.schema import Config

log = structlog.get_logger(__name__)


class RunDir:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.made_dir = False  # we created it (a managed node also owns one a crashed run left)
        self.made_token = False  # the router's token is ours (fresh each run), not the operator's

    def prepare(self) -> None:
        run = self.config.run_path
        # mkdir, then checked on the opened fd: a symlink or another user's dir is refused, not chmodded
        self.made_dir = owned.private_dir(run)
        # a kill -9'd predecessor's pid file and token (preflight found it dead) are replaced, never
        # written through: unlinked, then created anew
        write_new(run / "supervisor.pid", f"{os.getpid()}\n")
        # The default token (RUN_DIR/admin.token) is ours: fresh each run, removed at exit. A token
        # file named in the config is the operator's: used as is, created (and kept) only if missing.
        token = self.config.token_path
        if not self.config.router.admin_token_file or not token.exists():
            write_token(token)
            self.made_token = not self.config.router.admin_token_file
            log.info("admin_token_written", path=str(token))
        # A second token, not the router's: the engines' admin endpoints (POST /admin/kv) take only
        # this one, so neither an engine nor a holder of the operator's token file gets the other's.
        write_token(self.config.engine_token_path)

    def clean(self, *, owns_dir: bool) -> None:
        """Remove what we put there; the dir itself when ``owns_dir`` or we made it."""
        run = self.config.run_path
        (run / "supervisor.pid").unlink(missing_ok=True)
        self.config.engine_token_path.unlink(missing_ok=True)
        for report in run.glob("*.weights.json"):  # a vLLM instance's that never became ready (engine_kinds)
            report.unlink(missing_ok=True)
        if self.made_token:
            self.config.token_path.unlink(missing_ok=True)
        if self.made_dir or owns_dir:
            try:
                run.rmdir()
            except OSError as e:  # not empty: someone else's files; say which
                left = sorted(p.name for p in Path(run).iterdir()) if run.exists() else []
                log.warning("run_dir_not_removed", run_dir=str(run), error=str(e), left=left)


def write_token(path: Path) -> None:
    """A fresh random token in ``path``, created 0600 (never a file that was there before)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_new(path, secrets.token_hex(32) + "\n")


def write_new(path: Path, text: str) -> None:
    """``text`` in a new 0600 file at ``path``: what was there (a stale file, a symlink) is unlinked,
    not followed or truncated."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)

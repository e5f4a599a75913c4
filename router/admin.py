"""Admin API under /admin/: status, promote, drain, preempt, resume (bearer token, loopback).

The token is read once at start from a file that only this user (or root) owns and no other user can
read (:func:`read_token`); anything else is refused with a message that says how to fix it.
Comparison is constant-time.
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from aiohttp import web

from router.errors import AdminError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class TokenFileError(ValueError):
    """The admin token file is missing, empty, readable by others or owned by another user."""


def read_token(path: Path) -> bytes:
    """The bearer token in ``path``, refused unless only this user (or root) could have written it
    and no other user can read it.

    Accepted: a regular file owned by this user or by root, mode 0600/0400; or, as Kubernetes mounts
    a Secret with ``fsGroup``, owned by root, group one of this process's groups, mode 0440. The checks
    run on the opened file (fstat), so a path swapped between check and read gains nothing.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise TokenFileError(f"admin token file {path} does not exist; create it with a random token "
                             "and chmod 600") from exc
    except PermissionError as exc:
        raise TokenFileError(f"cannot read admin token file {path} as uid {os.geteuid()}: make it owned "
                             "by that user (chmod 600), or on Kubernetes mount the Secret with "
                             "defaultMode 0440 and the pod's fsGroup") from exc
    with os.fdopen(fd, "rb") as f:
        _check_token_file(path, os.fstat(f.fileno()))
        token = f.read(4096).strip()
    if not token:
        raise TokenFileError(f"admin token file {path} is empty; put a random token in it")
    return token


def _check_token_file(path: Path, st: os.stat_result) -> None:
    me = os.geteuid()
    if not stat.S_ISREG(st.st_mode):
        raise TokenFileError(f"admin token file {path} is not a regular file")
    if st.st_uid not in (me, 0):
        raise TokenFileError(f"admin token file {path} is owned by uid {st.st_uid}, not by uid {me} that "
                             f"runs the router (or root): that user chose the token; run: chown {me} {path}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IRWXO:
        raise TokenFileError(f"admin token file {path} is readable by others (mode {mode:o}); "
                             f"run: chmod 600 {path}")
    if mode & stat.S_IRWXG:
        ours = {os.getegid(), *os.getgroups()}
        secret_mount = st.st_uid == 0 and mode & stat.S_IRWXG == stat.S_IRGRP and st.st_gid in ours
        if not secret_mount:
            raise TokenFileError(f"admin token file {path} is open to group {st.st_gid} (mode {mode:o}); "
                                 f"run: chmod 600 {path} (group-read 0440 is accepted only for a root-owned "
                                 "file of one of the router's groups, as a Kubernetes Secret with fsGroup)")


def error_response(status: int, message: str, type_: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_}}, status=status)


class AdminAPI:
    """HTTP face of the router's operations; ``router`` is the app.Router (duck-typed here)."""

    def __init__(self, router, token: bytes | None) -> None:
        self.router = router
        self.token = token

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/admin/status", self._guard(self.status)),
                web.post("/admin/promote", self._guard(self.promote)),
                web.post("/admin/drain", self._guard(self.drain)),
                web.post("/admin/preempt", self._guard(self.preempt)),
                web.post("/admin/resume", self._guard(self.resume))]

    def _guard(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            if self.token is None:
                return error_response(403, "admin API disabled: start the router with an admin token "
                                      "file (--admin-token-file)", "forbidden")
            auth = request.headers.get("Authorization", "")
            given = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
            if not hmac.compare_digest(given, self.token):
                return web.json_response({"error": {"message": "missing or wrong bearer token",
                                                    "type": "unauthorized"}}, status=401,
                                         headers={"WWW-Authenticate": "Bearer"})
            try:
                return await handler(request)
            except AdminError as exc:
                return error_response(exc.status, str(exc), exc.type)
        return guarded

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.router.status())

    async def promote(self, request: web.Request) -> web.Response:
        args = await _args(request, required=("service",), optional=("to",))
        return web.json_response(await self.router.promote(args["service"], args.get("to")))

    async def drain(self, request: web.Request) -> web.Response:
        args = await _args(request, required=("instance",), optional=("timeout",))
        timeout = args.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise AdminError(400, "'timeout' must be a positive number of seconds", "invalid_request")
        return web.json_response(await self.router.drain(args["instance"], timeout))

    async def preempt(self, request: web.Request) -> web.Response:
        args = await _args(request, required=("service",), optional=("force",))
        force = args.get("force", False)
        if not isinstance(force, bool):
            raise AdminError(400, "'force' must be true or false", "invalid_request")
        return web.json_response(await self.router.preempt(args["service"], force))

    async def resume(self, request: web.Request) -> web.Response:
        args = await _args(request, required=("service",))
        return web.json_response(await self.router.resume(args["service"]))


async def _args(request: web.Request, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    try:
        body = msgspec.json.decode(await request.read() or b"{}")
    except msgspec.DecodeError as exc:
        raise AdminError(400, f"body is not JSON: {exc}", "invalid_request") from exc
    if not isinstance(body, dict):
        raise AdminError(400, "body must be a JSON object", "invalid_request")
    missing = [k for k in required if not isinstance(body.get(k), str)]
    if missing:
        raise AdminError(400, f"missing string field(s) {missing}", "invalid_request")
    unknown = sorted(set(body) - set(required) - set(optional))
    if unknown:
        raise AdminError(400, f"unknown field(s) {unknown}; allowed: {[*required, *optional]}",
                         "invalid_request")
    return body

"""Admin API under /admin/: status, promote, drain, preempt, resume (bearer token, loopback).

The token is read once at start from a file that only this user (or root) owns and no other user can
read (:func:`read_token`); anything else is refused with a message that says how to fix it.
Comparison is constant-time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from failover_common.tokens import TokenFileError, bearer_matches, read_token
from router.errors import AdminError

__all__ = ["AdminAPI", "TokenFileError", "read_token"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
            if not bearer_matches(request.headers.get("Authorization", ""), self.token):
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

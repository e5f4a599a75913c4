"""The operator's status page: ``/status`` (and ``/``), read-only, behind the admin token.

A visitor proves the token once, through a login form (the page then sets an HttpOnly,
SameSite=Strict cookie) or on every request with ``Authorization: Bearer <token>`` (curl). The
cookie carries an HMAC of the token, never the token: it opens this page only, not the admin API.
The page is one HTML file with its script and style beside it (package data, no external asset,
a Content-Security-Policy that allows nothing else); it follows the node live through
``/status/events`` (server-sent events): a document at once on every role change, and every
``interval`` seconds otherwise. The document is the admin API's status (a node's router adds its
daemon, zygote, slots and batch progress) plus the failover timeline (router.timeline).

Lifetime: the event streams end when the router shuts down (aiohttp's on_shutdown), so they never
hold its shutdown up to ``shutdown_timeout``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import html
import socket
import time
from importlib import resources

import msgspec
import structlog
from aiohttp import web

from failover_common.tokens import bearer_matches
from router.timeline import Timeline

log = structlog.get_logger(__name__)

COOKIE = "failover_status"
MAX_STREAMS = 32  # event streams open at once (each costs one status document per interval)
MAX_LOGIN_BYTES = 4096
ASSETS = {"status.js": "text/javascript", "status.css": "text/css"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
                    "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}


def _asset(name: str) -> bytes:
    return resources.files("router").joinpath("static", name).read_bytes()


class StatusPage:
    """Routes of the page; ``router`` is the app.Router (duck-typed: ``status()``, ``promoter``,
    ``watch_roles``). ``token`` None: the page is disabled, like the admin API."""

    def __init__(self, router, token: bytes | None, interval: float = 1.0) -> None:
        self.router, self.token, self.interval = router, token, interval
        self.session = None if token is None else hmac.new(token, b"failover status page v1", hashlib.sha256).hexdigest()
        self.timeline = Timeline(router.promoter)
        router.watch_roles(self._role_changed)
        self.streams: set[asyncio.Event] = set()  # one wake-up per open event stream
        self.closing = False
        self.node = socket.gethostname()
        self.pages = {name: _asset(name) for name in ("status.html", "login.html", *ASSETS)}

    def install(self, app: web.Application) -> None:
        app.add_routes([web.get("/", self.root), web.get("/status", self.page),
                        web.post("/status/login", self.login), web.post("/status/logout", self.logout),
                        web.get("/status/doc", self.doc), web.get("/status/events", self.events),
                        *(web.get(f"/status/{name}", self.asset) for name in ASSETS)])
        app.on_shutdown.append(self._shutdown)

    # -- access -----------------------------------------------------------------------------------
    def _allowed(self, request: web.Request) -> bool:
        if self.token is None:
            return False
        if bearer_matches(request.headers.get("Authorization", ""), self.token):
            return True
        cookie = request.cookies.get(COOKIE, "")
        return hmac.compare_digest(cookie.encode(), self.session.encode())

    def _refused(self, request: web.Request, message: str = "") -> web.Response:
        if self.token is None:
            return self._html(self._login_form("The status page is disabled: start the router with an admin "
                                               "token file (--admin-token-file).", False), 403)
        if request.path != "/status":  # data and streams: a plain 401, as the admin API answers
            return web.json_response({"error": {"message": "missing or wrong token: log in at /status or "
                                                "send Authorization: Bearer <token>", "type": "unauthorized"}},
                                     status=401, headers={"WWW-Authenticate": "Bearer", **SECURITY_HEADERS})
        return self._html(self._login_form(message, True), 401, {"WWW-Authenticate": "Bearer"})

    def _login_form(self, message: str, enabled: bool) -> bytes:
        text = self.pages["login.html"].decode()
        return (text.replace("{{message}}", html.escape(message))
                    .replace("{{disabled}}", "" if enabled else "disabled")).encode()

    def _html(self, body: bytes, status: int = 200, headers: dict | None = None) -> web.Response:
        return web.Response(body=body, status=status, content_type="text/html", charset="utf-8",
                            headers={**SECURITY_HEADERS, **(headers or {})})

    # -- handlers ---------------------------------------------------------------------------------
    async def root(self, request: web.Request) -> web.Response:
        raise web.HTTPSeeOther("/status")

    async def page(self, request: web.Request) -> web.Response:
        if not self._allowed(request):
            return self._refused(request)
        return self._html(self.pages["status.html"])

    async def asset(self, request: web.Request) -> web.Response:
        name = request.path.rsplit("/", 1)[1]  # no secret in them: the login form needs the style too
        return web.Response(body=self.pages[name], content_type=ASSETS[name], charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})

    async def login(self, request: web.Request) -> web.Response:
        if self.token is None:
            return self._refused(request)
        if (request.content_length or 0) > MAX_LOGIN_BYTES:
            return self._html(self._login_form("That is not a token.", True), 413)
        form = await request.post()
        given = str(form.get("token", "")).strip()
        if not hmac.compare_digest(given.encode(), self.token):
            log.warning("status_login_refused", peer=request.remote)
            return self._html(self._login_form("Wrong token: it is the content of the router's admin token "
                                               "file.", True), 401)
        log.info("status_login", peer=request.remote)
        resp = web.HTTPSeeOther("/status", headers=SECURITY_HEADERS)
        resp.set_cookie(COOKIE, self.session, httponly=True, samesite="Strict", path="/")
        raise resp

    async def logout(self, request: web.Request) -> web.Response:
        resp = web.HTTPSeeOther("/status")
        resp.del_cookie(COOKIE, path="/")
        raise resp

    async def doc(self, request: web.Request) -> web.Response:
        if not self._allowed(request):
            return self._refused(request)
        return web.Response(body=self._document(), content_type="application/json", headers=SECURITY_HEADERS)

    async def events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: ``event: status`` with the whole document, at once, then on every
        role change and every ``interval`` s, until the client goes or the router stops."""
        if not self._allowed(request):
            return self._refused(request)
        if len(self.streams) >= MAX_STREAMS:
            return web.json_response({"error": {"message": f"{MAX_STREAMS} status streams are open already",
                                                "type": "busy"}}, status=503, headers={"Retry-After": "5"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Accel-Buffering": "no",
                                           **SECURITY_HEADERS})
        await resp.prepare(request)
        wake = asyncio.Event()
        self.streams.add(wake)
        try:
            while not self.closing:
                await resp.write(b"event: status\ndata: " + self._document() + b"\n\n")
                try:
                    async with asyncio.timeout(self.interval):
                        await wake.wait()
                except TimeoutError:
                    pass
                wake.clear()
        except (ConnectionResetError, ConnectionError):
            pass  # the browser went away
        finally:
            self.streams.discard(wake)
        return resp

    # -- the document ------------------------------------------------------------------------------
    def _document(self) -> bytes:
        doc = self.router.status()
        doc["timeline"] = self.timeline.entries()
        doc["node"] = self.node
        doc["now"] = time.time()
        return msgspec.json.encode(doc)

    def _role_changed(self, inst, old: str, new: str, reason: str) -> None:
        self.timeline.role_changed(inst, old, new, reason)
        for wake in self.streams:
            wake.set()

    async def _shutdown(self, app: web.Application) -> None:
        self.closing = True
        for wake in self.streams:
            wake.set()

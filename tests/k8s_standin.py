"""A stand-in for the Kubernetes API server's coordination.k8s.io/v1 Leases, for tests.

No Kubernetes API server runs here. This follows the documented semantics that the Lease backend
relies on: create answers 409 AlreadyExists for an existing name; replace answers 409 Conflict when
metadata.resourceVersion is not the stored one (and 404 for a missing Lease); every write bumps one
resourceVersion counter shared by all objects (as etcd's revision does); LIST takes a
``labelSelector`` of ``key=value`` terms and answers a LeaseList with the list's resourceVersion;
DELETE removes; a bearer token is required. Not covered: watches, field selectors, server-side apply.

Run alone (a separate process, for a real router): ``python tests/k8s_standin.py PORT TOKEN_FILE``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from aiohttp import web

BASE = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


def status(code: int, reason: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                              "code": code, "message": reason}, status=code)


class StandIn:
    def __init__(self, token: str = "sekrit") -> None:
        self.token = token
        self.leases: dict[tuple[str, str], dict] = {}  # (namespace, name) -> object
        self.rv = 100
        self.requests: list[tuple[str, str, dict | None, str]] = []
        self.down = False  # answer 503 to everything (an API server that cannot reach its etcd)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        app.add_routes([web.post(BASE, self.create), web.get(BASE, self.list),
                        web.get(BASE + "/{name}", self.get), web.put(BASE + "/{name}", self.replace),
                        web.delete(BASE + "/{name}", self.delete)])
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        body = await request.json() if request.can_read_body else None  # read once, kept by aiohttp
        self.requests.append((request.method, request.path_qs, body, request.headers.get("Authorization", "")))
        if self.down:
            return status(503, "ServiceUnavailable")
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return status(401, "Unauthorized")
        return await handler(request)

    def _store(self, ns: str, body: dict) -> dict:
        stored = dict(body)
        self.rv += 1
        stored["metadata"] = dict(body["metadata"], namespace=ns, resourceVersion=str(self.rv))
        self.leases[(ns, body["metadata"]["name"])] = stored
        return stored

    async def create(self, request: web.Request) -> web.Response:
        body, ns = await request.json(), request.match_info["ns"]
        if (ns, body["metadata"]["name"]) in self.leases:
            return status(409, "AlreadyExists")
        return web.json_response(self._store(ns, body), status=201)

    async def get(self, request: web.Request) -> web.Response:
        lease = self.leases.get((request.match_info["ns"], request.match_info["name"]))
        return web.json_response(lease) if lease else status(404, "NotFound")

    async def list(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        terms = [t.split("=", 1) for t in request.query.get("labelSelector", "").split(",") if t]
        items = [obj for (n, _), obj in sorted(self.leases.items()) if n == ns and all(
            (obj["metadata"].get("labels") or {}).get(k) == v for k, v in terms)]
        return web.json_response({"kind": "LeaseList", "apiVersion": "coordination.k8s.io/v1",
                                  "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def replace(self, request: web.Request) -> web.Response:
        body, ns, name = await request.json(), request.match_info["ns"], request.match_info["name"]
        cur = self.leases.get((ns, name))
        if cur is None:
            return status(404, "NotFound")
        if body["metadata"].get("resourceVersion") != cur["metadata"]["resourceVersion"]:
            return status(409, "Conflict")
        return web.json_response(self._store(ns, body))

    async def delete(self, request: web.Request) -> web.Response:
        lease = self.leases.pop((request.match_info["ns"], request.match_info["name"]), None)
        if lease is None:
            return status(404, "NotFound")
        self.rv += 1
        return web.json_response({"kind": "Status", "status": "Success"})


async def _main(port: int, token_file: Path) -> None:
    runner = web.AppRunner(StandIn(token_file.read_text().strip()).app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"k8s stand-in on http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]), Path(sys.argv[2])))

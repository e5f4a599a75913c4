"""The Router: services and instances, the HTTP server, and the operations the supervisor calls.

Threading contract: every method runs in the event loop the router was started in (the supervisor
calls ``instance_exited`` from a task of that loop, or through ``loop.call_soon_threadsafe``).

    router = Router(RouterConfig(port=8000, admin_token_file=path), launcher)
    router.add_instance("chat", "chat-0", "http://127.0.0.1:9001", "primary", pid=1234)
    router.add_instance("chat", "chat-1", "http://127.0.0.1:9002", "standby", pid=1235)
    await router.start()
    ...
    router.instance_exited("chat-0", -9)     # instant failover to chat-1, fence, request_standby
    router.add_instance("chat", "chat-0", "http://127.0.0.1:9003", "standby", pid=1240)  # replacement
    ...
    await router.stop()
"""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web

from failover_common.tasks import Tasks

from router import states
from router.adapters import adapter_for
from router.admin import AdminAPI, read_token
from router.backend import Instance, Service
from router.config import RouterConfig
from router.errors import AdminError
from router.front import FrontSite
from router.health import HealthMonitor
from router.launcher import Launcher, NullLauncher
from router.looplag import LoopLag
from router.metrics import CONTENT_TYPE, Metrics
from router.promotion import Promoter
from router.proxy import Proxy, error_body
from router.status_page import StatusPage

log = structlog.get_logger(__name__)


class Router:
    def __init__(self, config: RouterConfig, launcher: Launcher | None = None, roles=None) -> None:
        self.config = config
        self.launcher = launcher if launcher is not None else NullLauncher()
        self.services: dict[str, Service] = {}
        self.metrics = Metrics()
        self.lag = LoopLag(self.metrics.loop_lag.observe)
        self.health = HealthMonitor(config, self._on_probe, self.lag,
                                    lambda inst, lag: self.metrics.probes_discounted.labels(inst.service, inst.name).inc())
        # Without a launcher nobody relaunches a fenced instance: it goes to STOPPED, not RELAUNCHING.
        self.promoter = Promoter(config, self.services, self.launcher, launcher is not None,
                                 self.metrics, self.health.confirm, roles)
        self.cluster = None  # a router.cluster.ClusterView when roles are decided in etcd
        self.all_metrics = None  # async () -> bytes: /metrics of every worker on the port (--workers)
        self.proxy = Proxy(config, self.services, self.promoter, self.metrics, self.lag.wake)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._stopped = False
        self._checks = Tasks()  # engine kinds' checks of new instances (_on_probe)
        self.port: int | None = None

    # -- instances ----------------------------------------------------------------------------
    def add_instance(self, service: str, name: str, url: str, role: str, pid: int | None = None, *,
                     engine: str = "failover", probe_path: str | None = None) -> Instance:
        """Register an instance (or re-register a relaunched/stopped/preempted one under its name).
        ``engine``: its kind (router/adapters: how its streams migrate); ``probe_path``: its
        liveness path (default: the kind's, vLLM's /health; for ours the config's probe_path)."""
        if role not in states.INITIAL_ROLES:
            raise ValueError(f"role must be one of {states.INITIAL_ROLES}, not {role!r}")
        adapter = adapter_for(engine)
        svc = self.services.get(service)
        if svc is None:
            svc = self.services[service] = Service(service, self.config.queue_size)
            svc.adapter = adapter
        elif svc.adapter is not adapter:
            raise ValueError(f"service {service!r} runs engine kind {svc.engine!r}, not {engine!r}")
        probe_path = probe_path or (adapter.probe_path if adapter is not None else self.config.probe_path)
        if role == states.PRIMARY and svc.primary is not None and svc.primary.name != name:
            raise ValueError(f"service {service!r} already has primary {svc.primary.name!r}; "
                             f"add {name!r} as a standby and promote it")
        inst = self._find(name)
        if inst is None:
            inst = Instance(service, name, url, role, pid, self.config.max_upstream,
                            self.config.upstream_queue_size)
            inst.probe_path = probe_path
            svc.instances[name] = inst
            log.info("instance_added", service=service, instance=name, url=inst.url, role=role, pid=pid)
            self.metrics.set_role(service, name, role)
            self.metrics.set_up(service, name, False)
        else:
            if inst.service != service:
                raise ValueError(f"instance {name!r} belongs to service {inst.service!r}")
            if inst.role in states.SERVING and not inst.fenced:
                raise ValueError(f"instance {name!r} is {inst.role}; remove it before re-adding")
            self._reregister(inst, url, role, pid)
            inst.probe_path = probe_path
        if role == states.PRIMARY:
            svc.primary = inst
        svc.refresh()
        if self._runner is not None:
            self.health.watch(inst)
        return inst

    def _reregister(self, inst: Instance, url: str, role: str, pid: int | None) -> None:
        old_session = inst._session
        inst._session = None
        if old_session is not None:
            self.promoter.spawn(old_session.close(), f"close-{inst.name}")
        inst.url, inst.pid = url.rstrip("/"), pid
        inst.generation += 1
        inst.fenced = inst.suspect = inst.ever_ready = False
        inst.failures = 0
        self.promoter.set_ready(inst, False, "re-registered")
        if inst.role != role:
            self.promoter.set_role(inst, role, "re-registered")

    def watch_roles(self, listener) -> None:
        """Call ``listener(instance, old_role, new_role, reason)`` after every role change (in the
        event loop, synchronously: a listener schedules its work, it never blocks)."""
        self.promoter.role_listeners.append(listener)

    def register(self, service: str, name: str, url: str, role: str, pid: int | None, *,
                 engine: str = "failover", probe_path: str | None = None) -> None:
        """A launcher's ready instance: added, or re-registered when it is out of service
        (relaunching, stopped, preempted); one the router still routes (a resumed standby whose
        engine was started again) keeps its role and only learns its new pid."""
        inst = self._find(name)
        if inst is None or inst.role in states.OUT_OF_SERVICE:
            self.add_instance(service, name, url, role, pid=pid, engine=engine, probe_path=probe_path)
        else:
            inst.pid = pid

    def knows(self, name: str) -> bool:
        """Whether instance ``name`` is registered."""
        return self._find(name) is not None

    def knows_service(self, service: str) -> bool:
        """Whether ``service`` has had an instance registered."""
        return service in self.services

    def queue_depth(self, service: str) -> int:
        """Requests of ``service`` waiting for a primary plus those in flight (0: unknown service)."""
        svc = self.services.get(service)
        return 0 if svc is None else svc.waiting + sum(i.inflight for i in svc.instances.values())

    def primary(self, service: str) -> Instance | None:
        """The serving primary of ``service``, if any (read-only for callers)."""
        svc = self.services.get(service)
        inst = svc.primary if svc is not None else None
        return inst if inst is not None and inst.role == states.PRIMARY else None

    async def preempted(self, service: str) -> None:
        """The launcher evicts ``service`` itself (co-serving): stop routing to it, ask nothing back."""
        if service in self.services:
            await self.promoter.preempt(self.services[service], evict=False)

    async def resumed(self, service: str) -> None:
        """The launcher started ``service`` again itself: its preempted instances become standbys."""
        if service in self.services:
            await self.promoter.resume(self.services[service], self.health.watch, relaunch=False)

    def remove_instance(self, name: str) -> None:
        """Forget ``name``: no more requests or probes (its process is the caller's business)."""
        inst = self._get(name)
        svc = self.services[inst.service]
        inst.fenced = True
        if inst.role != states.STOPPED:
            self.promoter.set_role(inst, states.STOPPED, "removed")
        del svc.instances[name]
        self.metrics.forget(inst.service, name)
        if svc.primary is inst:
            svc.primary = None
            self.promoter.promote_best(svc, "primary removed")
        svc.refresh()
        self.promoter.spawn(inst.close_session(), f"close-{name}")

    def instance_exited(self, name: str, returncode: int | None) -> None:
        """Instant failure notice from whoever launched ``name`` (its process is gone)."""
        inst = self._find(name)
        if inst is None:
            log.warning("exit_of_unknown_instance", instance=name, returncode=returncode)
            return
        if self._stopped:  # shutting down: engines exit on purpose, nothing to fail over to
            inst.pid = None
            return
        self.promoter.instance_exited(inst, returncode)

    async def failover_settled(self, service: str) -> None:
        """Returns once the requests the last failover of ``service`` broke have resumed on the new
        primary (at most ``replace_settle_timeout``). A launcher that replaces an exited engine by
        itself should await this first: the replacement's start competes for the same CPU/GPU."""
        await self.promoter.settled(self._service(service))

    def _on_probe(self, inst: Instance, generation: int, ok: bool, why: str, latency: float) -> None:
        if ok and not inst.ever_ready and generation == inst.generation and not inst.fenced:
            check = getattr(self.services[inst.service].adapter, "check", None)
            if check is not None:  # its engine kind's check, once per registration (vLLM's cut leak)
                self._checks.spawn(check(inst), f"check-{inst.name}")
        self.promoter.on_probe(inst, generation, ok, why, latency)

    def _find(self, name: str) -> Instance | None:
        for svc in self.services.values():
            if name in svc.instances:
                return svc.instances[name]
        return None

    def _get(self, name: str) -> Instance:
        inst = self._find(name)
        if inst is None:
            known = sorted(n for svc in self.services.values() for n in svc.instances)
            raise AdminError(404, f"unknown instance {name!r}; known: {known}", "not_found")
        return inst

    def _service(self, name: str) -> Service:
        svc = self.services.get(name)
        if svc is None:
            raise AdminError(404, f"unknown service {name!r}; known: {sorted(self.services)}", "not_found")
        return svc

    # -- operations (admin API and supervisor) -------------------------------------------------
    def status(self) -> dict:
        doc = {"services": [svc.as_json() for svc in self.services.values()],
               "last_failover": self.promoter.last_failover}
        if self.cluster is not None:
            doc["cluster"] = self.cluster.as_json()
        return doc

    async def promote(self, service: str, to: str | None = None) -> dict:
        return await self.promoter.switchover(self._service(service), to)

    async def drain(self, instance: str, timeout: float | None = None) -> dict:
        return await self.promoter.drain(self._get(instance), timeout)

    async def preempt(self, service: str, force: bool = False) -> dict:
        """Evict a batch service; an online one only with ``force`` (its clients then get 503)."""
        svc = self._service(service)
        if not force and not self.launcher.is_batch(service):
            raise AdminError(409, f"{service!r} is an online service: preempting it stops its primary "
                             "and standbys, and its clients get 503 until `failover resume`. Preempt is "
                             f"for batch services; to do it anyway: failover preempt {service} --force",
                             "conflict")
        result = await self.promoter.preempt(svc)
        if force:
            log.warning("online_service_preempted", service=service, hint="failover resume brings it back")
        return result

    async def resume(self, service: str) -> dict:
        return await self.promoter.resume(self._service(service), self.health.watch)

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self.port is not None, "router not started"
        return f"http://{self.config.host}:{self.port}"

    def build_app(self) -> web.Application:
        token = read_token(self.config.admin_token_file) if self.config.admin_token_file else None
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[_json_errors])
        app.add_routes(AdminAPI(self, token).routes())
        self.status_page = StatusPage(self, token)  # /status and /: read-only, the same token
        self.status_page.install(app)
        app.add_routes([web.get("/health", self._health), web.get("/ready", self._ready),
                        web.get("/metrics", self._metrics),
                        web.route("*", "/v1/{tail:.*}", self.proxy.handle)])
        return app

    async def start(self) -> None:
        """Bind, serve, start probing. Raises OSError if the port is taken, TokenFileError on a bad token."""
        app = self.build_app()
        # handler_cancellation: a client that disconnects cancels its handler, hence the upstream request.
        # auto_decompress=False: aiohttp would inflate on the event loop, uncapped until read() and
        # still labelled gzip; router/body.py decodes in a thread, capped, and drops the label.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, auto_decompress=False,
                                     shutdown_timeout=self.config.shutdown_timeout)
        await self._runner.setup()
        # Plain proxied requests on router/front.py's lean listener, all else on aiohttp's.
        self._site = FrontSite(self._runner, self.config, self.proxy)
        await self._site.start()
        self.port = self._runner.addresses[0][1]
        self.lag.start()  # before the first probe: a probe's verdict needs the loop's lag
        for svc in self.services.values():
            for inst in svc.instances.values():
                self.health.watch(inst)
        log.info("router_started", host=self.config.host, port=self.port,
                 services={n: list(s.instances) for n, s in self.services.items()})

    async def stop(self) -> None:
        """Ordered shutdown; each step bounded, the last one cancels what is left."""
        if self._runner is None:
            return
        self._stopped = True
        # 1. Waiting requests get their 503 now rather than at their deadline.
        for svc in self.services.values():
            svc.closing = True
            svc.refresh()
        # 2. Stop probing, so no verdict fences or promotes anything mid-shutdown; and checking.
        await self._step("health", self.health.stop())
        await self._checks.stop()
        await self.lag.stop()
        if self.cluster is not None:  # and leave the cluster: peers see this router's record go
            await self._step("cluster", self.cluster.stop())
        # 3. Close the listener, let in-flight requests finish (shutdown_timeout), cancel the rest.
        await self._runner.cleanup()
        self._runner = self._site = None
        # 4. Launcher calls in flight (fence, request_standby) get a bounded wait, then cancel.
        await self.promoter.tasks.stop(grace=self.config.shutdown_timeout)
        # 5. Upstream pools last: nothing uses them any more.
        for svc in self.services.values():
            for inst in svc.instances.values():
                await inst.close_session()
        log.info("router_stopped")

    async def _step(self, name: str, coro) -> None:
        """One step of ``stop``, given ``shutdown_timeout``: a step that has not ended by then is
        logged with every task still pending, and left behind (a stop must end; the full suite once
        waited 300 s on one here, twice in all, and it was not found)."""
        task = asyncio.ensure_future(coro)
        done, _ = await asyncio.wait({task}, timeout=self.config.shutdown_timeout)
        if done:
            task.result()
            return
        task.cancel()
        pending = [f"{t.get_name()}: {_where(t)}" for t in asyncio.all_tasks()
                   if not t.done() and t is not asyncio.current_task()]
        log.error("router_stop_step_stuck", step=name, after_s=self.config.shutdown_timeout, pending=pending,
                  hint="the rest of the stop goes on; please report this with the pending tasks")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"alive": True})

    async def _ready(self, request: web.Request) -> web.Response:
        """200 when every online service has a routable primary. Batch services are listed but do not
        count: one that is preempted, done or failed must not take the router out of a balancer's
        rotation (a node with batch services only counts those)."""
        serves = self.cluster.serves if self.cluster is not None else lambda svc: svc.routable() is not None
        ready = {name: serves(svc) for name, svc in self.services.items()}
        counted = [ok for name, ok in ready.items() if not self.launcher.is_batch(name)] or list(ready.values())
        ok = bool(counted) and all(counted)
        return web.json_response({"ready": ok, "services": ready}, status=200 if ok else 503)

    def metrics_text(self) -> bytes:
        for svc in self.services.values():
            self.metrics.queued.labels(svc.name).set(svc.waiting)
        self.metrics.buffered.set(self.proxy.bodies.buffered)
        return self.metrics.render()

    async def _metrics(self, request: web.Request) -> web.Response:
        # one of N workers on one port (router/worker_metrics.py): every worker's samples, labelled
        body = await self.all_metrics() if self.all_metrics is not None else self.metrics_text()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


@web.middleware
async def _json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own 404/405 (no such route) as an OpenAI-style error, like every other answer."""
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        message = f"Invalid URL ({request.method} {request.rel_url.raw_path[:200]})"
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return web.json_response(error_body(message, "invalid_request_error", exc.status),
                                 status=exc.status, headers=headers)


def _where(task: asyncio.Task) -> str:
    """Where a pending task waits: its innermost frame, as file:line function."""
    stack = task.get_stack()
    if not stack:
        return "?"
    f = stack[-1]
    return f"{f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno} {f.f_code.co_name}"

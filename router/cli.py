"""``failover router``: the router alone, in front of engines it did not start.

    failover router --backend chat-0=http://127.0.0.1:9001 --standby chat-1=http://127.0.0.1:9002

Detection is HTTP only (probes and failed requests); fencing means never routing to the instance
again. The first --backend is the primary; further --backend and every --standby are standbys.
``--service`` names the service (default: "default"); requests go to it whatever their ``model``.

    failover router --etcd http://10.0.0.5:2379,http://10.0.0.6:2379 --host 0.0.0.0 --port 8000

With ``--etcd`` the router is a peer of a cluster (docs/cluster.md): it learns the instances and the
primaries of every service from etcd watches, and promotes only by a compare-and-swap there.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import structlog

from failover_common import cpus, gc_pauses
from failover_common.etcd import Etcd
from failover_common.k8s_store import KubeStore, in_cluster_defaults
from failover_common.logs import configure_logging
from router import evloop
from router.admin import TokenFileError
from router.app import Router
from router.adapters import ENGINES
from router.cluster import join
from router.config import RouterConfig
from router.launcher import NullLauncher
from router.roles import EtcdRoles
from router.share_client import ShareClient
from router.worker_metrics import WorkerMetrics

log = structlog.get_logger(__name__)


def _name_url(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected NAME=http://HOST:PORT, got {text!r}")
    return name, url


MAX_WORKERS = 64  # more router processes than this on one host is a typo, not a plan


def cpu_list(text: str) -> frozenset[int]:
    """``--cpus``: a CPU list (failover_common.cpus) naming only CPUs this process may run on."""
    try:
        return cpus.check(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def worker_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of router processes, got {text!r}") from None
    if not 1 <= n <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"--workers must be 1..{MAX_WORKERS}, not {n} (one per core to spare "
                                         "is the most that helps; docs/router.md)")
    return n


def parser() -> argparse.ArgumentParser:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="failover router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", action="append", type=_name_url, default=[], metavar="NAME=URL",
                   help="an engine; the first one is the primary")
    p.add_argument("--standby", action="append", type=_name_url, default=[], metavar="NAME=URL",
                   help="a standby engine (may repeat)")
    p.add_argument("--service", default="default", help="service name (default: %(default)s)")
    p.add_argument("--host", default=d.host, help="listen address (default: %(default)s, loopback)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--admin-token-file", type=Path, help="0600 file with the admin bearer token")
    p.add_argument("--probe-path", default=None,
                   help=f"readiness path (default: the engine kind's: {d.probe_path}, vllm: /health)")
    p.add_argument("--engine", choices=ENGINES, default="failover",
                   help="the backends' engine kind: how their streams are migrated (docs/vllm.md)")
    p.add_argument("--probe-interval", type=float, default=d.probe_interval)
    p.add_argument("--probe-timeout", type=float, default=d.probe_timeout)
    p.add_argument("--failure-threshold", type=int, default=d.failure_threshold)
    p.add_argument("--queue-size", type=int, default=d.queue_size)
    p.add_argument("--queue-deadline", type=float, default=d.queue_deadline)
    p.add_argument("--max-retries", type=int, default=d.max_retries)
    p.add_argument("--max-migrations", type=int, default=d.max_migrations)
    p.add_argument("--stall-timeout", type=float, default=d.stall_timeout)
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="one request body, as sent and decompressed (default: %(default)s)")
    p.add_argument("--max-buffered-bytes", type=int, default=d.max_buffered_bytes,
                   help="all request bodies held at once; past it: 503 (default: %(default)s)")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help="seconds for a whole request body to arrive; past it: 408 (default: %(default)s)")
    p.add_argument("--forward-path", action="append", default=[], metavar="PATH",
                   help=f"forward one more exact path (always: {', '.join(d.forward_paths)}); may repeat")
    p.add_argument("--max-upstream", type=int, default=d.max_upstream,
                   help="requests in flight to one instance at once (default: %(default)s)")
    p.add_argument("--upstream-queue-size", type=int, default=d.upstream_queue_size,
                   help="requests waiting in the router for one of those (default: %(default)s)")
    p.add_argument("--loop-lag-tolerance", type=float, default=d.loop_lag_tolerance,
                   help="a probe timed out while the router's own loop lagged more is not counted "
                        "(seconds, default: %(default)s)")
    p.add_argument("--hang-probe-timeout", type=float, default=d.hang_probe_timeout,
                   help="every stream of the primary silent and a probe unanswered this long: hung, "
                        "failed over at once (seconds, 0: off, default: %(default)s)")
    p.add_argument("--replace-settle-timeout", type=float, default=d.replace_settle_timeout,
                   help="after a failover, wait at most this for the broken requests to resume before "
                        "asking for a replacement (seconds, default: %(default)s)")
    p.add_argument("--loop", choices=evloop.KINDS, default="auto",
                   help="event loop: uvloop when installed (auto), or force one (default: %(default)s)")
    p.add_argument("--etcd", action="append", default=[], metavar="URL[,URL...]",
                   help="etcd endpoints: be a peer router of that cluster (no --backend needed)")
    p.add_argument("--k8s-lease", default=None, metavar="NAMESPACE",
                   help="instead of etcd: the cluster's state in Kubernetes Lease objects of that namespace "
                        "(docs/cluster.md)")
    p.add_argument("--k8s-api", default=None, metavar="URL",
                   help="the API server (default in a pod: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT)")
    p.add_argument("--k8s-token-file", type=Path, default=None,
                   help="bearer token (default in a pod: the service account's)")
    p.add_argument("--k8s-ca-file", type=Path, default=None, help="the API server's CA (default in a pod: the "
                   "service account's)")
    p.add_argument("--cluster", default="default", help="cluster name in etcd (default: %(default)s)")
    p.add_argument("--router-id", default=None, help="this router's name in etcd (default: host-pid)")
    p.add_argument("--ttl", type=int, default=5,
                   help="lease TTL in seconds; also how long routing goes on without etcd (default: %(default)s)")
    p.add_argument("--advertise", default=None, help="URL under which peers and `failover status` see it")
    p.add_argument("--workers", type=worker_count, default=1,
                   help="router processes on the one port (SO_REUSEPORT), sharing roles through a role store "
                        "of the parent process (default: %(default)s; docs/router.md says when more pay)")
    p.add_argument("--share", type=Path, default=None, help=argparse.SUPPRESS)  # a worker: the role store's socket
    p.add_argument("--worker-id", type=int, default=0, help=argparse.SUPPRESS)  # 1..N: one of N workers
    p.add_argument("--cpus", type=cpu_list, default=None, metavar="LIST",
                   help="run on these CPUs only, e.g. 0 or 2-3: cores the engines do not use "
                        "(docs/operations.md, \"A core for the router\"; default: the kernel's choice)")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str]) -> int:
    p, d = parser(), RouterConfig()
    args = p.parse_args(argv)
    if args.etcd and args.k8s_lease:
        print("failover router: give --etcd or --k8s-lease, not both", file=sys.stderr)
        return 2
    if args.k8s_lease:
        try:
            args.k8s_api, args.k8s_token_file, args.k8s_ca_file = in_cluster_defaults(
                args.k8s_api, args.k8s_token_file, args.k8s_ca_file, os.environ)
        except ValueError as exc:
            print(f"failover router: {exc}", file=sys.stderr)
            return 2
    if args.workers > 1 and not args.worker_id:
        print("failover router: --workers N > 1 runs through `failover router` (it starts the workers)", file=sys.stderr)
        return 2
    if bool(args.share) != bool(args.worker_id):
        print("failover router: --share and --worker-id come together (the parent of N workers gives both)",
              file=sys.stderr)
        return 2
    if args.share and (args.etcd or args.k8s_lease):
        print("failover router: a worker (--share) takes its roles from its parent, not etcd", file=sys.stderr)
        return 2
    if not args.backend and not args.etcd and not args.k8s_lease and not args.share:
        p.print_usage(sys.stderr)
        print("failover router: give at least one --backend NAME=URL (or --etcd ENDPOINTS)", file=sys.stderr)
        return 2
    if (args.backend or args.standby) and (args.etcd or args.k8s_lease or args.share):
        print("failover router: with --etcd/--k8s-lease the instances come from the cluster; drop --backend/--standby",
              file=sys.stderr)
        return 2
    if args.ttl < 1:
        print(f"failover router: --ttl must be at least 1 s, not {args.ttl}", file=sys.stderr)
        return 2
    names = [n for n, _ in args.backend + args.standby]
    if len(set(names)) != len(names):
        print(f"failover router: instance names must be unique, got {names}", file=sys.stderr)
        return 2
    try:
        config = RouterConfig(
            host=args.host, port=args.port, admin_token_file=args.admin_token_file,
            probe_path=args.probe_path or d.probe_path, probe_interval=args.probe_interval,
            probe_timeout=args.probe_timeout, failure_threshold=args.failure_threshold,
            queue_size=args.queue_size, queue_deadline=args.queue_deadline,
            max_retries=args.max_retries, max_migrations=args.max_migrations,
            stall_timeout=args.stall_timeout, max_body_bytes=args.max_body_bytes,
            max_buffered_bytes=args.max_buffered_bytes, body_timeout=args.body_timeout,
            forward_paths=tuple(dict.fromkeys(d.forward_paths + tuple(args.forward_path))),
            max_upstream=args.max_upstream, upstream_queue_size=args.upstream_queue_size,
            loop_lag_tolerance=args.loop_lag_tolerance, replace_settle_timeout=args.replace_settle_timeout,
            hang_probe_timeout=args.hang_probe_timeout, reuse_port=args.worker_id > 0)
    except ValueError as exc:
        print(f"failover router: {exc}", file=sys.stderr)
        return 2
    try:
        evloop.factory(args.loop)
    except RuntimeError as exc:  # --loop uvloop without uvloop
        print(f"failover router: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, process=f"router-worker-{args.worker_id}" if args.worker_id else "router")
    if args.cpus:
        cpus.pin_self(args.cpus)
    try:
        return evloop.run(_serve(config, args), args.loop)
    except (TokenFileError, OSError) as exc:
        print(f"failover router: {exc}", file=sys.stderr)
        return 1


async def _serve(config: RouterConfig, args: argparse.Namespace) -> int:
    etcd = view = None
    deadline = max(0.2, min(1.0, args.ttl / 4))  # each call's, per member: a frozen one costs this
    if args.k8s_lease:
        etcd = KubeStore.connect(args.k8s_api, args.k8s_lease, args.cluster, token_file=args.k8s_token_file,
                                 ca_file=args.k8s_ca_file, timeout=deadline, poll=max(0.1, args.ttl / 8))
    elif args.etcd:
        etcd = Etcd([ep for arg in args.etcd for ep in arg.split(",") if ep], timeout=deadline)
    elif args.share:  # one of N workers on this port: the parent's role store is its etcd
        etcd = ShareClient(args.share, timeout=deadline)
    if etcd is not None:
        rid = args.router_id or (f"worker-{args.worker_id}" if args.worker_id else f"{socket.gethostname()}-{os.getpid()}")
        roles = EtcdRoles(etcd, args.cluster, rid)
        router = Router(config, launcher=NullLauncher(warn=args.worker_id <= 1, cluster=not args.share), roles=roles)
        view = join(router, etcd, roles, directory=True, ttl=args.ttl,
                    url=args.advertise or f"http://{config.host}:{config.port}")
    else:
        router = Router(config, launcher=None)
        (first, url), *rest = args.backend
        kind = {"engine": args.engine, "probe_path": args.probe_path}
        router.add_instance(args.service, first, url, "primary", **kind)
        for name, url in rest + args.standby:
            router.add_instance(args.service, name, url, "standby", **kind)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    metrics = None
    if args.share:  # /metrics answers for every worker on the port (router/worker_metrics.py)
        metrics = WorkerMetrics(rid, router.metrics_text, lambda: view.routers)
        view.extra |= {"worker": args.worker_id, "metrics_url": await metrics.start()}
        router.all_metrics = metrics.all
    await router.start()
    pauses = gc_pauses.started(router.metrics.registry, "failover_router_", loop, log)
    if view is not None:
        view.url = args.advertise or router.url
        view.start()
    print(f"failover router listening on {router.url} ({evloop.name(args.loop)})", file=sys.stderr, flush=True)
    await stop.wait()
    log.info("router_stopping")
    await router.stop()
    pauses.remove()
    if metrics is not None:
        await metrics.stop()
    if etcd is not None:
        await etcd.close()
    return 0

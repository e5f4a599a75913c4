"""``failover router``: the router alone (``router/cli.py``), or ``--workers N`` of it on one port.

With the default ``--workers 1`` this is ``router.cli.main``, unchanged. With N > 1 this process
starts N router workers on the same host:port (``failover.procs.router_pool``), holds the role store
they share, registers the ``--backend``/``--standby`` instances there (the first backend is the
primary), restarts a worker that dies, and stops them all on SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import structlog

from failover_common import cpus
from failover_common.logs import configure_logging
from router import cli, evloop

log = structlog.get_logger(__name__)

# options that the parent consumes; every other option goes to each worker as given
_PARENT_ONLY = {"--backend": 1, "--standby": 1, "--workers": 1, "--service": 1}


def worker_argv(argv: list[str]) -> list[str]:
    """``argv`` without the options this process handles itself (both ``--opt V`` and ``--opt=V``)."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in _PARENT_ONLY:
            skip = 0 if "=" in a else _PARENT_ONLY[name]
            continue
        out.append(a)
    return out


def main(argv: list[str]) -> int:
    args = cli.parser().parse_args(argv)  # every error (a bad --workers too) is argparse's, exit 2
    if args.workers == 1 or args.worker_id:
        return cli.main(argv)
    if args.etcd or args.k8s_lease:
        print("failover router: --workers N > 1 shares roles through this process; a peer router of an etcd "
              "cluster is one process (run more peers behind your balancer)", file=sys.stderr)
        return 2
    if not args.backend:
        print("failover router: give at least one --backend NAME=URL", file=sys.stderr)
        return 2
    if args.port == 0:
        print("failover router: --workers N > 1 needs a fixed --port (with 0 each worker would pick its own)",
              file=sys.stderr)
        return 2
    names = [n for n, _ in args.backend + args.standby]
    if len(set(names)) != len(names):
        print(f"failover router: instance names must be unique, got {names}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, process="router-pool")
    if args.cpus:  # this process and so its workers (they pin themselves too: --cpus is passed on)
        cpus.pin_self(args.cpus)
    return evloop.run(_serve(args, worker_argv(argv)), "asyncio")


async def _serve(args, rest: list[str]) -> int:
    from failover.procs.child import ChildFailed
    from failover.procs.router_pool import RouterPool

    pool = RouterPool(rest, args.workers, cluster=args.cluster)
    (first, _), *_ = args.backend
    for name, url in args.backend + args.standby:
        pool.put_instance(args.service, name, url, engine=args.engine if args.engine != "failover" else None,
                          probe_path=args.probe_path)
    pool.seed_primary(args.service, first)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        await pool.start()
        print(f"failover router listening on http://{args.host}:{args.port} ({args.workers} workers, "
              f"pids {pool.pids()})", file=sys.stderr, flush=True)
        failed = asyncio.ensure_future(pool.failed.wait())
        waiting = asyncio.ensure_future(stop.wait())
        await asyncio.wait({failed, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if failed.done():
            print("failover router: every worker kept dying; see their logs above", file=sys.stderr)
            code = 1
        failed.cancel()
        waiting.cancel()
    except (ChildFailed, OSError) as exc:
        print(f"failover router: {exc}", file=sys.stderr)
        code = 1
    finally:
        await pool.stop()
    return code

"""``failover up CONFIG``: run a node in the foreground until Ctrl-C (or SIGTERM), then stop clean.

Progress goes to stderr as plain lines; the structured logs of every process of the node go there too.
Exit codes: 0 after a clean shutdown, 1 when the node could not start, 2 for a bad config.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

import structlog

from failover_common import gc_pauses
from failover_common.logs import configure_logging
from failover.config.preflight import preflight
from failover.config.schema import ConfigError, load_config

log = structlog.get_logger(__name__)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="failover up", description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path, help="node config (TOML), e.g. deploy/examples/cpu.toml")
    p.add_argument("--launch", choices=["zygote", "spawn"], default=None,
                   help="override supervisor.launch: fork engines from the zygote, or spawn them cold")
    return p.parse_args(argv)


def progress_printer(start: float):
    def progress(text: str) -> None:
        print(f"[failover up +{time.monotonic() - start:6.1f}s] {text}", file=sys.stderr, flush=True)
    return progress


async def serve(config, progress) -> int:
    from failover.node.supervisor import Supervisor  # imports the router and aiohttp: after arg checks

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    supervisor = Supervisor(config, progress=progress, batch_bar=sys.stderr.isatty())
    starting = asyncio.ensure_future(supervisor.start())
    stopper = asyncio.ensure_future(stop.wait())
    code = 0
    try:
        await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done() and starting.exception() is None:
            # the router runs in this process: its collections timed, what start built frozen
            pauses = gc_pauses.started(supervisor.router.metrics.registry, "failover_router_", loop, log)
            progress("ready; Ctrl-C stops the node")
            await stopper
            pauses.remove()
            progress("shutting down")
        elif starting.done():
            err = starting.exception()
            print(f"failover up: the node did not start: {err}", file=sys.stderr)
            code = 1
        else:
            progress("interrupted while starting; shutting down")
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
    finally:
        stopper.cancel()
        await supervisor.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    progress("stopped")
    return code


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    try:
        config = load_config(a.config)
        if a.launch:
            import msgspec

            config = msgspec.structs.replace(
                config, supervisor=msgspec.structs.replace(config.supervisor, launch=a.launch))
        preflight(config)
    except ConfigError as e:
        print(f"failover up: {e}", file=sys.stderr)
        return 2
    configure_logging(config.supervisor.log_level, process="supervisor")
    return asyncio.run(serve(config, progress_printer(time.monotonic())))

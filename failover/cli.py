"""The ``failover`` command: one entry point, a subcommand per component.

Each subcommand lives next to the component it drives and exposes ``main(argv) -> int``; this module
only dispatches, so importing it costs nothing (torch is imported by the subcommands that need it).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

# subcommand -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "tiny-model": ("failover.tools.tiny_model", "write a small random-weight Llama-family checkpoint"),
    "daemon": ("cache_daemon.cli", "run the per-node weight cache daemon"),
    "engine": ("engine.cli", "run the reference OpenAI-compatible engine"),
    "router": ("failover.cmd.router", "run the active-standby router alone in front of engines (--workers N)"),
    "up": ("failover.cmd.up", "bring up daemon, engines and router from a config file"),
    "status": ("failover.cmd.admin", "show services and instances"),
    "promote": ("failover.cmd.admin", "promote a standby to primary"),
    "drain": ("failover.cmd.admin", "stop routing to an instance and wait for its requests"),
    "preempt": ("failover.cmd.admin", "evict a batch service"),
    "resume": ("failover.cmd.admin", "let a preempted batch service come back"),
    "demo": ("failover.cmd.demo", "tiny model on CPU: bring the stack up, kill the primary, print the timeline"),
}


def version() -> str:
    """The installed distribution's version (pyproject's), or the source tree's when not installed."""
    try:
        return importlib.metadata.version("failover")
    except importlib.metadata.PackageNotFoundError:
        from failover import __version__
        return __version__


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: failover COMMAND [ARGS...]    (failover --version: the installed version)", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "run 'failover COMMAND --help' for a command's options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"failover {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"failover: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    # Admin commands share one module; they get their own name as the first argument.
    if COMMANDS[name][0] == "failover.cmd.admin":
        rest = [name, *rest]
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

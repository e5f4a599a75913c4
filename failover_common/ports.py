"""Free TCP ports: whether one is free (preflight), and picking some (tests, benchmarks, the demo,
the engine's tensor-parallel rendezvous).

``bind(("", 0))`` hands out a port from the kernel's ephemeral range, the same range outgoing
connections take their source ports from; a port picked that way can be taken by any client socket
before the server binds it (seen in CI: an engine failed with EADDRINUSE). So ports are drawn at
random from below the ephemeral range instead, and checked free before they are handed out.
"""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32000  # below Linux's default ephemeral range (32768-60999)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind ``host:port`` now (IPv4 or IPv6; a port in TIME_WAIT is free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int = 1, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive free ports (a primary and its standbys use a run)."""
    rng = random.SystemRandom()
    for _ in range(1000):
        first = rng.randrange(LOW, HIGH - count)
        if all(port_is_free(first + i, host) for i in range(count)):
            return first
    raise OSError(f"no {count} consecutive free ports in {LOW}-{HIGH} on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)

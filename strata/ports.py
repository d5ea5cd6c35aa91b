"""Free TCP ports for processes we start ourselves (a router's replicas, a benchmark's servers, a
soak's cluster), chosen so that nothing else takes them before the process binds.

Asking the kernel for port 0 hands back a port from the ephemeral range, the same range every
outgoing connection takes its local port from. Between choosing such a port and the server
binding it, a connection opened meanwhile (a replica reaching Redis, a client reaching a router)
may be given that very port, and the server then fails with EADDRINUSE. So the ports come from
below the ephemeral range, where the kernel never hands out ports by itself, picked at random
(two processes choosing at once rarely meet) and never twice by one process.
"""

from __future__ import annotations

import random
import socket
import threading

# Below this no port is chosen: the registered services people run by hand live there.
LOWEST = 20000
_FALLBACK_EPHEMERAL_START = 32768
_TRIES = 200

_lock = threading.Lock()
_given: set[tuple[str, int]] = set()


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (ip_local_port_range), 32768 if unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_START


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nobody holds now, outside the ephemeral range when it can be.

    Another process can still bind it before the caller does; outside the ephemeral range only a
    process choosing ports by itself can, which is what the random choice makes unlikely.
    """
    top = ephemeral_start()
    rng = random.SystemRandom()
    with _lock:
        if top - LOWEST > 100:
            for _ in range(_TRIES):
                port = rng.randrange(LOWEST, top)
                if (host, port) not in _given and _bindable(host, port):
                    _given.add((host, port))
                    return port
        while True:  # the range is tiny or full: take what the kernel gives
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if (host, port) not in _given:
                _given.add((host, port))
                return port

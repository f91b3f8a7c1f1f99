"""Free TCP ports for listeners this package starts (side channels, test servers).

Ports come from below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`, 32768-60999 by default): a port
the kernel handed out for `bind(0)` sits in that range, and between the probe and the real listener's bind an
outgoing connection (UCX, HTTP, the side channel) may be given the same port, and the listener then fails with
EADDRINUSE. Outgoing connections never take a port outside the range."""

from __future__ import annotations

import random
import socket

from connector.core.errors import ConfigError

LOWEST = 10000


def ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int = 1, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A base port p such that p .. p+count-1 are all free on `host` now, outside the ephemeral range."""
    low, high = ephemeral_range()
    spans = [(LOWEST, low - count), (high + 1, 65535 - count)]
    spans = [(a, b) for a, b in spans if b > a]
    if not spans:
        raise ConfigError(f"no room for {count} ports outside the ephemeral range {low}-{high}")
    for _ in range(attempts):
        a, b = random.choice(spans)
        base = random.randint(a, b)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise ConfigError(f"no {count} consecutive free ports on {host} outside the ephemeral range {low}-{high} "
                      f"after {attempts} tries")

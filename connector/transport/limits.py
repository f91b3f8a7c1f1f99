"""What one side-channel server lets its peers use: connections (in all, per source address, handshakes in
progress), frame sizes before and after authentication, messages per second per connection, and failed
authentication attempts per source address. Each limit logs one clear line when it triggers.

Asyncio, on the server's event loop; no I/O of its own."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass

from connector.protocol.messages import DEFAULT_MAX_FRAME_BYTES, HANDSHAKE_MAX_FRAME_BYTES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """Limits of one side-channel server (one prefill rank). The defaults fit a cluster: far above what prefill and
    decode engines use (one connection per decode rank, a few messages per request), far below what hurts."""

    max_connections: int = 512
    """Open connections in all, handshakes included."""
    max_connections_per_host: int = 128
    """Open connections from one source address (a decode node opens one per decode rank and prefill rank)."""
    max_handshakes: int = 64
    """Handshakes in progress at once; more wait at the TCP accept queue's end (they are closed at once)."""
    handshake_frame_bytes: int = HANDSHAKE_MAX_FRAME_BYTES
    """Largest frame accepted before the peer has authenticated."""
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Largest frame accepted after the handshake."""
    messages_per_s: float = 5000.0
    """Per connection: messages read per second (a burst of as many is allowed); beyond it the server reads more
    slowly, so a flooding peer is slowed down by TCP itself and nothing is dropped."""
    max_auth_failures: int = 10
    """Failed authentications from one source address within `auth_failure_window_s`; beyond it that address's
    connections are closed unread until the window has passed."""
    auth_failure_window_s: float = 60.0
    auth_failure_delay_s: float = 0.5
    """How long the answer to a failed authentication is held back (a guess costs the guesser this much)."""


class AdmissionGuard:
    """Counts connections and failed authentications per source address; `admit` says why one is refused."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.open: dict[str, int] = defaultdict(int)
        """Open connections per source host."""
        self.handshakes = 0
        self._failures: dict[str, deque[float]] = {}
        self._locked_logged: dict[str, float] = {}

    @property
    def total(self) -> int:
        return sum(self.open.values())

    def admit(self, host: str) -> str | None:
        """None (and the connection counted) if a connection from `host` may start its handshake, else why not."""
        lim = self.limits
        if self.locked_out(host):
            return (f"{host} failed authentication {lim.max_auth_failures} times within {lim.auth_failure_window_s:g} s "
                    f"(setting max_auth_failures); its connections are closed until that window has passed")
        if self.total >= lim.max_connections:
            return f"{lim.max_connections} connections are open (setting max_connections)"
        if self.open[host] >= lim.max_connections_per_host:
            return f"{host} has {self.open[host]} connections open (setting max_connections_per_host)"
        if self.handshakes >= lim.max_handshakes:
            return f"{lim.max_handshakes} handshakes are in progress (setting max_handshakes)"
        self.open[host] += 1
        self.handshakes += 1
        return None

    def handshake_done(self) -> None:
        self.handshakes -= 1

    def release(self, host: str) -> None:
        self.open[host] -= 1
        if self.open[host] <= 0:
            del self.open[host]

    def auth_failed(self, host: str) -> None:
        self._failures.setdefault(host, deque()).append(time.monotonic())
        if len(self._failures) > 4096:  # many offending addresses: forget those whose window has passed
            for other in list(self._failures):
                self._recent_failures(other)

    def locked_out(self, host: str) -> bool:
        return self._recent_failures(host) >= self.limits.max_auth_failures

    def should_log_lockout(self, host: str) -> bool:
        """Log a lockout once per window per address, not once per refused connection."""
        now = time.monotonic()
        for old in [h for h, at in self._locked_logged.items() if now - at >= self.limits.auth_failure_window_s]:
            del self._locked_logged[old]  # bounded: only addresses locked out within the window stay
        if host in self._locked_logged:
            return False
        self._locked_logged[host] = now
        return True

    def _recent_failures(self, host: str) -> int:
        """Failures of `host` within the window; older ones (and addresses left with none) are forgotten."""
        times = self._failures.get(host)
        if times is None:
            return 0
        horizon = time.monotonic() - self.limits.auth_failure_window_s
        while times and times[0] < horizon:
            times.popleft()
        if not times:
            del self._failures[host]
        return len(times)


class RateLimiter:
    """Token bucket: `take()` returns at once while the peer stays under `rate` messages per second (bursts of
    `rate`), and otherwise sleeps until it is back under it. The first slow-down of a connection is logged."""

    def __init__(self, rate: float, who: str) -> None:
        self.rate, self.who = rate, who
        self._tokens = rate
        self._at = time.monotonic()
        self.throttled = 0
        """Messages that had to wait."""

    async def take(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return
        if not self.throttled:
            log.warning("%s sends more than %g messages per second (setting messages_per_s): reading from it more "
                        "slowly", self.who, self.rate)
        self.throttled += 1
        await asyncio.sleep((1 - self._tokens) / self.rate)
        self._tokens = 0.0
        self._at = time.monotonic()

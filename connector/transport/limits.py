"""What one side-channel server lets its peers use: connections (in all, per source address, not yet authenticated:
in all, per source address, and for how long), frame sizes before and after authentication, messages per second per
connection, and failed authentication attempts per (source address, claimed identity). Each limit logs a clear line
when it triggers (at a bounded rate: connector.transport.refusals); the bookkeeping is
connector.transport.admission.

Asyncio, on the server's event loop; no I/O of its own."""

from __future__ import annotations

import asyncio
import logging
import time
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
    """Connections not yet authenticated (from accept: TLS, Hello, Auth), in all; a newer one evicts the oldest of
    the address holding most. (Claims of an identity that authenticated before are not counted: they have their own
    lane, connector.transport.admission.)"""
    max_handshakes_per_host: int = 8
    """Connections not yet authenticated from one source address; a newer one evicts that address's oldest. A
    decode node opens one per decode rank and prefill rank at a time, each authenticated within milliseconds."""
    handshake_deadline_s: float = 5.0
    """From accept until the peer's proof checked out (the TLS handshake, Hello and Auth): a connection not
    authenticated by then is closed. (handshake_timeout_s, if shorter, applies instead.) A machine whose processes
    can stall for seconds (several engines sharing few cores) needs more, as it needs a longer handshake_timeout_s."""
    handshake_frame_bytes: int = HANDSHAKE_MAX_FRAME_BYTES
    """Largest frame accepted before the peer has authenticated."""
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Largest frame accepted after the handshake."""
    messages_per_s: float = 5000.0
    """Per connection: messages read per second (a burst of as many is allowed); beyond it the server reads more
    slowly, so a flooding peer is slowed down by TCP itself and nothing is dropped."""
    max_auth_failures: int = 10
    """Failed authentications from one source address claiming one identity (engine id, pp rank, tp rank) within
    `auth_failure_window_s`; beyond it such connections are closed after their Hello until the window has passed.
    Never for an identity that authenticated from that address before (locking it out is what a guesser on its host
    would want); each failure is answered late all the same."""
    auth_failure_window_s: float = 60.0
    auth_failure_delay_s: float = 0.5
    """How long the answer to a failed authentication is held back (a guess costs the guesser this much)."""
    known_identities: int = 4096
    """(address, identity) pairs remembered as having authenticated, least recently used forgotten first."""
    refusal_log_interval_s: float = 10.0
    """Refused or failed connections: the first few of each interval are logged in full, the others in one summary
    line with counts at its end (connector.transport.refusals); all are counted."""


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

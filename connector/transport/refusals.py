"""Refused and failed side-channel connections: counted by kind (a metric), and logged at a bounded rate. An outsider
can open thousands of connections a second; one full line each would let it write megabytes of log a second. So the
first few refusals of an interval are logged in full (what an operator needs to see the cause at once) and the rest
of the interval in one summary line with the counts, when the interval ends.

Asyncio, on the server's event loop (the summary is a loop timer)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Callable

LOGGED_PER_INTERVAL = 5
"""Refusals logged in full per interval; the others of the interval go into its summary line."""
KINDS = ("limit", "evicted", "deadline", "frame", "auth", "locked_out", "refused", "closed", "probe")
"""What went wrong: a connection limit (max_connections, max_connections_per_host); evicted from the pending budget
by a newer connection; the handshake deadline passed; a bad frame (size, version, undecodable, wrong type); a wrong
proof; claimed an identity locked out after wrong proofs; refused by a check (another model, a limit of the engine);
the peer closed or lost the connection during the handshake; a probe asking what listens (a first frame Reject:
examples/proxy.py's start-up check), logged at INFO."""


class RefusalLog:
    """Counts refusals per kind (`counts`, cumulative) and logs them at a bounded rate (`lines`: lines written).
    `on_refusal(kind)` (optional) is called for each, e.g. to feed the engine's metrics."""

    def __init__(self, logger: logging.Logger, interval_s: float,
                 on_refusal: Callable[[str], None] | None = None) -> None:
        self.log, self.interval_s, self.on_refusal = logger, interval_s, on_refusal
        self.counts: Counter[str] = Counter()
        self.lines = 0
        self._started = -float("inf")
        self._in_interval = 0
        self._suppressed: Counter[str] = Counter()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def note(self, kind: str, message: str, *args: object, level: int = logging.WARNING) -> None:
        """One refused or failed connection of `kind` (KINDS); `message % args` is its line (at `level`) if it gets
        one."""
        assert kind in KINDS, kind
        self.counts[kind] += 1
        if self.on_refusal is not None:
            try:
                self.on_refusal(kind)
            except Exception:  # noqa: BLE001 - counting must not break the server
                self.log.exception("on_refusal failed")
        now = time.monotonic()
        if now - self._started >= self.interval_s:
            self._flush()
            self._started, self._in_interval = now, 0
        self._in_interval += 1
        if self._in_interval <= LOGGED_PER_INTERVAL:
            self.lines += 1
            self.log.log(level, message, *args)
            return
        self._suppressed[kind] += 1
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, self._started + self.interval_s - now),
                                                                self._flush)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._suppressed:
            return
        counts = ", ".join(f"{n} {kind}" for kind, n in self._suppressed.most_common())
        self.lines += 1
        self.log.warning("side channel: %d more connections refused or failed in the last %g s (%s; not logged "
                         "one by one: setting refusal_log_interval_s)", sum(self._suppressed.values()),
                         self.interval_s, counts)
        self._suppressed.clear()

    def close(self) -> None:
        """Log what is pending now (the server is closing)."""
        self._flush()

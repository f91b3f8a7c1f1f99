"""Hand memory that waiting registrations held back to the system once they are gone.

Why. Waiting registrations (connector.engine.sender_state.Parked) hold their block ids packed, 4 bytes an id, as
they arrive (protocol 6). When a peer's many waiting registrations go at once (its connections closed, their leases
ran out), glibc keeps the freed memory in its arenas: measured on a prefill process, 40 connections that parked
268 MB left +357 MB of RSS after they closed. `malloc_trim(0)` returns
the free pages of every arena. It runs off the event loop, only after the waiting registrations dropped by
`TRIM_AFTER_BYTES` since the last trim (what went, not what is left: a burst parked and dropped between
two ticks counts), at most once per `TRIM_INTERVAL_S`."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from typing import Any, Callable

log = logging.getLogger(__name__)
TRIM_AFTER_BYTES = 16 << 20
TRIM_INTERVAL_S = 5.0


def _malloc_trim() -> Callable[[], Any] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


class ParkedTrim:
    """`after(dropped_bytes, spawn)` each lease tick, with the bytes waiting registrations that went held in all
    (Ownership.parked_bytes_dropped): starts a trim (with `spawn`) once enough went since the last one."""

    def __init__(self) -> None:
        self._trimmed_at_bytes = 0
        self._last = 0.0
        self._trim = _malloc_trim()
        self.trims = 0
        """Trims that have run to their end."""

    def after(self, dropped_bytes: int, spawn: Callable[[Any], Any]) -> None:
        now = time.monotonic()
        if self._trim is None or dropped_bytes - self._trimmed_at_bytes < TRIM_AFTER_BYTES \
                or now - self._last < TRIM_INTERVAL_S:
            return
        self._trimmed_at_bytes, self._last = dropped_bytes, now
        log.debug("waiting registrations that held %d B in all went: trimming the heap", dropped_bytes)
        spawn(self._run(self._trim))

    async def _run(self, trim: Callable[[], Any]) -> None:
        await asyncio.to_thread(trim)
        self.trims += 1

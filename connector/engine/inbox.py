"""The hand-off from the framework's thread (vLLM's forward) to the sender's event loop.

Hook calls only append to a deque (atomic under the GIL), drained FIFO on the loop, so their order is kept. A wake
(`call_soon_threadsafe`: a syscall, then the loop thread taking the GIL from the forward between two ops) is paid
only where the loop has something to do at once: per step (start, end of chunk, abort), and per layer only while
the request has a decode rank to write to (`streaming`). Until a decode registers, a computed layer can go
nowhere, so its hook wakes nobody: the registration drains the deque first. The loop used to poll the deque every
0.5 ms instead: 2,000 GIL grabs a second from the forward for as long as any request computed, which took about
9 ms of prefill's core per 3,000-token request on the tiny model and grew with the compute (docs/performance.md)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Callable

log = logging.getLogger(__name__)


class Inbox:
    def __init__(self, loop: asyncio.AbstractEventLoop, backstop_s: float, name: str) -> None:
        """`backstop_s`: while some transfer streams, the longest a queued call waits unwoken (the one race below)."""
        self.loop, self.backstop_s, self.name = loop, backstop_s, name
        self._calls: deque = deque()
        self._wake = asyncio.Event()
        self.streaming: set[str] = set()
        """Transfers still computing that have a decode rank to write to: their layer hooks wake the loop (kept on
        the loop, read from the framework thread: a set's membership test is atomic under the GIL)."""

    def __len__(self) -> int:
        return len(self._calls)

    # ---- framework thread ----------------------------------------------------------------------------------------
    def put(self, fn: Callable[..., Any], *args: Any, wake: bool) -> None:
        self._calls.append((fn, *args))
        if wake:
            self.loop.call_soon_threadsafe(self._wake.set)

    def put_layer(self, transfer_id: str, fn: Callable[..., Any], *args: Any) -> None:
        """A layer hook: wakes the loop only if `transfer_id` has somewhere to send the layer now."""
        self.put(fn, transfer_id, *args, wake=transfer_id in self.streaming)

    # ---- loop ----------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Drain on every wake, forever (cancel to stop)."""
        while True:
            # The timeout is a backstop for one race only: a layer hook that read `streaming` just before a
            # registration added its transfer, and queued after that registration drained (the next layer's hook,
            # or the end of the chunk, would wake the loop anyway).
            try:
                async with asyncio.timeout(self.backstop_s if self.streaming else None):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()  # before the drain: a wake that comes during it runs another pass
            self.drain()

    def drain(self) -> None:
        """Run the queued calls, in order (on the loop)."""
        while self._calls:
            fn, *args = self._calls.popleft()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one bad call must not stop the engine
                log.exception("%s: %s%r failed", self.name, fn.__name__, tuple(args))

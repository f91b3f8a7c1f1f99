"""Layers whose KV is in place once a CUDA event completes (prefill on a GPU), waited for together: the layers one
wake of the loop drains (connector.engine.inbox batches short layers) cost one wait in a worker thread, on the last
of their events, not one each.

Why the last alone: the forward records every layer's event, and the end of step's, on its one stream, in the order
the hooks queue them, and events on one stream complete in the order recorded. So once the last has completed, every
earlier one has. (A layer's event is recorded again in the next step; the last one queued is still the newest.)"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class LayerEvents(Generic[T]):
    """`add(item, event)` on the loop; once `event` and every event added before it in the same turn completed,
    `ready(item)` runs on the loop for each, in the order added. `spawn` runs the waiting coroutine (an owner that
    logs its failure: connector.transport.loop.OwnedTasks.spawn)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, spawn: Callable[[Any], Any],
                 ready: Callable[[T], None]) -> None:
        self.loop, self._spawn, self._ready = loop, spawn, ready
        self._pending: list[tuple[T, Any]] = []
        self.waits = 0
        """Worker-thread waits started (tests, metrics)."""

    def add(self, item: T, event: Any) -> None:
        if not self._pending:
            self.loop.call_soon(self._flush)  # after the rest of this turn: the drain may hold more layers
        self._pending.append((item, event))

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if batch:
            self.waits += 1
            self._spawn(self._after(batch))

    async def _after(self, batch: list[tuple[T, Any]]) -> None:
        await asyncio.to_thread(batch[-1][1].synchronize)  # never block the loop on the GPU
        for item, _event in batch:
            self._ready(item)

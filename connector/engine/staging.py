"""Both halves of a staged chunk (why: connector.core.staging_ranges), on the engines' event loop; copies run in
worker threads.

Sender (`StagedWriter`): gather a destination's scattered descriptors into this rank's staging buffer, post ONE
descriptor into the slot decode gave this connection, ask decode to scatter it (`Scatter`), and wait for its answer
(`Scattered`) before the slot is used again.
Receiver (`StagedReader`): a slot of this rank's staging buffer per prefill rank connection; check that every
destination of a chunk lies inside the blocks registered for its transfer, then scatter it from the slot."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Callable

import numpy as np

from connector.core.errors import StagedWriteError, StagingError, WriteAbandoned
from connector.core.staging_ranges import Slots, check_destinations, chunks, split_long
from connector.engine.rank import LocalRank
from connector.protocol.messages import Scatter, Scattered
from connector.transport.control import ControlConnection
from connector.transport.device_copy import copy_ranges
from connector.transport.nixl import WriteTiming


class StagedWriter:
    def __init__(self, transport: Any, me: LocalRank, timeout_s: float,
                 on_write: Callable[[WriteTiming], None] = lambda timing: None) -> None:
        """`me.staging`: a contiguous tensor on the KV device, registered with `transport`. `on_write` hears the
        timing of every chunk's NIXL WRITE."""
        self.transport, self.me, self.timeout_s, self.on_write = transport, me, timeout_s, on_write
        self._local = asyncio.Lock()
        """One chunk at a time in this rank's staging buffer (held from the gather until its WRITE completed)."""
        self._slot_locks: dict[Any, asyncio.Lock] = {}
        """Per decode connection: its slot holds one chunk until decode answered Scattered."""
        self._waits: dict[tuple[Any, str, int], asyncio.Future] = {}
        self._seq = itertools.count()

    def usable(self, slot_bytes: int, peer_staging_addr: int) -> bool:
        return slot_bytes > 0 and peer_staging_addr != 0

    def forget(self, key: Any) -> None:
        """That destination's connection ended: drop its slot lock (nothing of it can wait any more)."""
        self._slot_locks.pop(key, None)

    def on_scattered(self, key: Any, msg: Scattered) -> None:
        fut = self._waits.get((key, msg.transfer_id, msg.seq))
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def write(self, key: Any, conn: ControlConnection, peer_agent: str, transfer_id: str,
                    local: np.ndarray, remote: np.ndarray, remote_base: int, remote_device: int,
                    slot_bytes: int, stop: Callable[[], bool] = lambda: False) -> int:
        """Move descriptor arrays `local` -> `remote` ([n, 3]) through staging, chunk by chunk, in order, until
        `stop()` says the destination is gone (aborted). Returns the number of chunks sent."""
        limit = min(slot_bytes, self.me.staging_bytes)
        local, remote = split_long(local, remote, limit)
        lock = self._slot_locks.setdefault(key, asyncio.Lock())
        sent = 0
        for a, b in chunks(local[:, 1], limit):
            if stop():
                break
            lens = local[a:b, 1]
            n = int(lens.sum())
            async with lock:
                async with self._local:
                    packed = self.me.staging_addr + np.cumsum(lens) - lens  # the chunk's ranges, back to back
                    await asyncio.to_thread(copy_ranges, local[a:b, 0], packed, lens, self.me.staging.device)
                    try:
                        self.on_write(await self.transport.write(
                            peer_agent, [(self.me.staging_addr, n)], [(remote_base, n)], mem_type=self.me.mem_type,
                            local_device=self.me.staging_device, remote_device=remote_device, timeout=self.timeout_s))
                    except WriteAbandoned as exc:  # NIXL still reads the staging buffer: no gather may refill it
                        await asyncio.wait([exc.settled])
                        raise
                await self._scatter(key, conn, transfer_id, n, remote[a:b, :2])
            sent += 1
        return sent

    async def _scatter(self, key: Any, conn: ControlConnection, transfer_id: str, nbytes: int,
                       destinations: np.ndarray) -> None:
        seq = next(self._seq)
        fut = asyncio.get_running_loop().create_future()
        self._waits[(key, transfer_id, seq)] = fut
        try:
            await conn.send(Scatter(transfer_id, seq, nbytes, destinations.astype("<i8").tobytes()))
            done, _ = await asyncio.wait({fut, conn.closed}, timeout=self.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waits.pop((key, transfer_id, seq), None)
        if fut not in done:
            why = "the connection closed" if conn.closed in done else f"no answer within {self.timeout_s:g} s"
            raise StagedWriteError(f"staged chunk {seq} ({nbytes} B): {why}")
        reply = fut.result()
        if not reply.ok:
            raise StagedWriteError(f"decode refused staged chunk {seq}: {reply.reason}")


class StagedReader:
    def __init__(self, me: LocalRank, slot_bytes: int) -> None:
        """`me.staging` (if any): a contiguous tensor on the KV device, registered with this rank's transport, cut
        into slots of `slot_bytes` (fewer than one: no slots, every prefill rank writes directly)."""
        self.me = me
        nbytes = me.staging_bytes
        self.slots = Slots(nbytes, min(slot_bytes, nbytes) if nbytes else 0)

    async def scatter(self, msg: Scatter, slot: int, allowed: tuple[np.ndarray, np.ndarray]) -> None:
        """Copy chunk `msg` from `slot` to its destinations. Raises StagingError, with nothing written, unless the
        destinations add up to the chunk, fit the slot and each lies inside one of the `allowed` byte ranges."""
        pairs = np.frombuffer(msg.destinations, dtype="<i8")
        if pairs.size % 2:
            raise StagingError("staged destinations are not (address, length) pairs")
        dst, lens = pairs.reshape(-1, 2).T
        slot_bytes = self.slots.slot_bytes
        if (lens <= 0).any() or int(lens.sum()) != msg.nbytes or msg.nbytes > slot_bytes:
            raise StagingError(f"staged chunk of {msg.nbytes} B does not match its destinations "
                               f"({int(lens.sum())} B) or exceeds the {slot_bytes}-B slot")
        check_destinations(dst, lens, allowed)
        packed = self.me.staging_addr + slot + np.cumsum(lens) - lens
        await asyncio.to_thread(copy_ranges, packed, dst, lens, self.me.staging.device)

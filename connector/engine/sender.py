"""Per-layer streaming sender (prefill side). Framework-agnostic asyncio; runs on the process's one event loop.

A request's layers go out as soon as two things are known: the layer is computed (`layer_ready`, or the sweep at
the end of a chunk) and the decode rank's registration (its block ids) has arrived. Whichever comes second
triggers the WRITE, so a registration that arrives after prefill finished is served from the kept blocks (bulk
fallback) by the same code. Every route is keyed by (pool, global layer) from the plan; slots never cross ranks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict, deque
from typing import Any, Callable

from connector.core.errors import InputError
from connector.core.plan import fold_ranges
from connector.engine.config import SenderConfig
from connector.engine.rank import LocalRank
from connector.engine.sender_state import (Destination, FinishedInfo, PeerInfo, RecentIds, SendRequest,
                                          lease_expiry_note, validate_registration)
from connector.engine.batch_writer import BatchWriter
from connector.engine.stats import SenderStats
from connector.protocol.handshake import PeerKey, accept_peer, peer_key
from connector.protocol.messages import (Abort, Complete, Heartbeat, Hello, Message, Register, RegisterAck,
                                         RegisterError, Scattered, Stopped)
from connector.transport.control import ControlConnection, ControlServer
from connector.transport.loop import OwnedTasks

log = logging.getLogger(__name__)


class StreamSender:
    """One prefill rank. Thread-safe entry points (`start_request`, `begin_chunk`, `layer_ready`, `end_chunk`,
    `abort`) return at once and hand the work to the event loop; everything else runs on the loop."""

    def __init__(self, me: LocalRank, transport: Any, config: SenderConfig, loop: asyncio.AbstractEventLoop,
                 on_finished: Callable[[str, bool], None] | None = None) -> None:
        """`transport`: this rank's connector.transport.nixl.Transport, with `me.regions` (and `me.staging`, if
        any) registered. With a staging buffer, decode ranks that have one too get scattered blocks as staged
        chunks (connector.engine.staging), others direct WRITEs (connector.engine.batch_writer chooses)."""
        self.me, self.transport, self.config, self.loop = me, transport, config, loop
        self.on_finished = on_finished
        self.stats = SenderStats()
        self.writer = BatchWriter(me, transport, config, self.stats)
        self.requests: dict[str, SendRequest] = {}
        self._parked: dict[str, list[tuple[ControlConnection, Register, float]]] = defaultdict(list)
        self._released = RecentIds(config.released_memory_s)
        self._given_up = RecentIds(config.released_memory_s)
        """Transfers decode aborted before prefill started them -> when (forgotten after released_memory_s)."""
        self.finished_info: dict[str, FinishedInfo] = {}
        """Finished transfers, kept as long as `_released` (stats, late waiters)."""
        self._peers: dict[PeerKey, PeerInfo] = {}
        self._tasks = OwnedTasks(f"prefill rank {me.rank}")
        self._server: ControlServer | None = None
        self._inbox: deque = deque()
        self._wake = asyncio.Event()
        self.hello = me.hello("prefill", transport)

    @property
    def port(self) -> int:
        """The side channel's bound port (after `start()`)."""
        return self._server.port if self._server is not None else self.config.port

    @property
    def peers(self) -> dict[PeerKey, PeerInfo]:
        """Accepted decode ranks: their plan, regions and NIXL agent name."""
        return self._peers

    # ---- lifetime -------------------------------------------------------------------------------------------
    async def start(self) -> int:
        """Start the side-channel server; returns the bound port."""
        side = self.config.side_channel
        self._server = ControlServer(
            self.hello, self._on_message, host=self.config.host, port=self.config.port,
            auth_token=side.auth_token, on_hello=self._on_hello, handshake_timeout_s=side.handshake_timeout_s,
            heartbeat_interval_s=side.heartbeat_interval_s, dead_after_s=side.dead_after_s)
        await self._server.start()
        self._tasks.spawn(self._lease_loop())
        self._tasks.spawn(self._drain_loop())
        return self._server.port

    async def aclose(self) -> None:
        """Stop every task this sender runs (awaited), close the side channel, forget the decode ranks' agents."""
        await self._tasks.aclose()
        if self._server is not None:
            await self._server.aclose()
        for peer in self._peers.values():
            await asyncio.to_thread(self.transport.remove_peer, peer.agent)  # NIXL calls stay off the loop
        self._peers.clear()

    # ---- framework-thread entry points (return at once) -------------------------------------------------------
    # They only append to a deque (atomic under the GIL). Waking the loop costs a syscall and a GIL hand-off of
    # ~100 us, too much for a per-layer hook, so only the per-step calls wake it; while requests are active the loop
    # drains the deque every `poll_interval_s` anyway. Order is kept: one deque, drained FIFO.
    def start_request(self, transfer_id: str, num_tokens: int) -> None:
        self._inbox.append((self._start_request, transfer_id, num_tokens))
        self._wake_loop()

    def begin_chunk(self, transfer_id: str, block_ids: list[list[int]], computed_tokens: int) -> None:
        """The next forward computes tokens up to `computed_tokens`, into `block_ids` (per group, from token 0)."""
        self._inbox.append((self._begin_chunk, transfer_id, block_ids, computed_tokens))

    def layer_ready(self, transfer_id: str, global_layer: int, event: Any = None) -> None:
        """Layer `global_layer` holds this chunk's tokens (after `event`, a CUDA event, completes)."""
        self._inbox.append((self._layer_ready, transfer_id, global_layer, event))

    def end_chunk(self, transfer_id: str, event: Any = None) -> None:
        """Every layer of this rank holds this chunk's tokens: sends what no `layer_ready` covered (the sweep)."""
        self._inbox.append((self._layer_ready, transfer_id, None, event))
        self._wake_loop()

    def abort(self, transfer_id: str, reason: str) -> None:
        self._inbox.append((self._abort, transfer_id, reason))
        self._wake_loop()

    def _wake_loop(self) -> None:
        self.loop.call_soon_threadsafe(self._wake.set)

    async def _drain_loop(self) -> None:
        while True:
            # Poll only while some request is still computing (hooks can come); requests that wait for decode
            # or their lease need no polling.
            if self._inbox or any(not r.final for r in self.requests.values()):
                await asyncio.sleep(self.config.poll_interval_s)
            else:
                self._wake.clear()
                await self._wake.wait()
            self._drain_inbox()

    def _drain_inbox(self) -> None:
        """Run the framework thread's queued calls, in order (on the loop)."""
        while self._inbox:
            fn, *args = self._inbox.popleft()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one bad call must not stop the engine
                log.exception("prefill rank %s: %s%r failed", self.me.rank, fn.__name__, tuple(args))

    # ---- loop side -------------------------------------------------------------------------------------------
    def _start_request(self, transfer_id: str, num_tokens: int) -> None:
        if transfer_id in self.requests:
            log.error("transfer %s started twice; ignoring the second start", transfer_id)
            return
        req = SendRequest(transfer_id, num_tokens, [], finished=self.loop.create_future())
        self.requests[transfer_id] = req
        if self._given_up.discard(transfer_id):
            log.info("transfer %s: decode gave it up before prefill started; its KV is not kept", transfer_id)
            req.expected, req.failed = set(), True
        for conn, reg, _at in self._parked.pop(transfer_id, []):
            self._tasks.spawn(self._accept(conn, reg))

    def _begin_chunk(self, transfer_id: str, block_ids: list[list[int]], computed_tokens: int) -> None:
        req = self.requests.get(transfer_id)
        if req is None:
            log.error("begin_chunk for unknown transfer %s", transfer_id)
            return
        moved = any(new[:len(old)] != old[:len(new)] for new, old in zip(block_ids, req.block_ids))
        if computed_tokens < req.computed_tokens or moved:
            # vLLM preempted and is recomputing the request, possibly into other blocks: nothing counts as ready
            # until recomputed, and everything is sent again (a WRITE in flight may have read a reused block).
            log.warning("transfer %s: prefill restarted at %d tokens (was %d); resending from scratch",
                        transfer_id, computed_tokens, req.computed_tokens)
            req.generation += 1
            req.ready_tokens.clear()
            for dest in req.dests.values():
                dest.sent_tokens.clear()
        req.block_ids = [list(g) for g in block_ids]
        req.computed_tokens = computed_tokens

    def _layer_ready(self, transfer_id: str, global_layer: int | None, event: Any) -> None:
        req = self.requests.get(transfer_id)
        if req is None:
            return  # aborted or finished: nothing to send
        tokens = req.computed_tokens
        if event is not None:
            self._tasks.spawn(self._after_event(req, global_layer, tokens, event))
        else:
            self._mark_ready(req, global_layer, tokens)

    async def _after_event(self, req: SendRequest, global_layer: int | None, tokens: int, event: Any) -> None:
        await asyncio.to_thread(event.synchronize)  # never block the loop on the GPU
        self._mark_ready(req, global_layer, tokens)

    def _mark_ready(self, req: SendRequest, global_layer: int | None, tokens: int) -> None:
        start, end = self.me.stage
        layers = range(start, end) if global_layer is None else (global_layer,)
        for layer in layers:
            req.ready_tokens[layer] = max(req.ready_tokens.get(layer, 0), tokens)
        if global_layer is None and tokens >= req.num_tokens:
            req.final = True
            req.lease_deadline = time.monotonic() + self.config.lease_s
        self._pump(req)

    def _abort(self, transfer_id: str, reason: str) -> None:
        self._parked.pop(transfer_id, None)
        req = self.requests.get(transfer_id)
        if req is None:
            return
        for dest in req.dests.values():
            if not dest.done:
                self._stop_dest(req, dest, Abort(transfer_id, f"prefill aborted: {reason}"))
        # Nothing new is posted; writes already reading the source blocks finish first, so the blocks are only
        # handed back (finished) once nobody reads them, and decode hears of it only once nothing more lands.
        req.final, req.failed, req.expected = True, True, set()
        self._check_finished(req, ok=False)

    # ---- registration ----------------------------------------------------------------------------------------
    async def _on_hello(self, hello: Hello) -> None:
        """Check a decode rank before it is accepted: its layout must be one our plan can serve."""
        accepted = accept_peer(hello, self.hello, self.me.model)
        key = accepted.key
        # NIXL peer calls can wait behind a DRAM copy in progress: keep them off the loop.
        old = self._peers.get(key)
        if old is not None and old.accepted.hello.agent_metadata != hello.agent_metadata:
            await asyncio.to_thread(self.transport.remove_peer, old.agent)  # that rank restarted
        agent = await asyncio.to_thread(self.transport.add_peer, hello.agent_metadata)
        self._peers[key] = PeerInfo(accepted, agent)

    async def _on_message(self, conn: ControlConnection, msg: Message) -> None:
        """Decode rank -> this rank, in order, one method per message."""
        match msg:
            case Register():
                await self._on_register(conn, msg)
            case Scattered():
                if self.writer.staged is not None:
                    self.writer.staged.on_scattered(conn, msg)
            case Heartbeat():
                self._on_heartbeat(msg)
            case Abort():
                await self._on_abort(conn, msg)
            case _:
                log.warning("prefill %s: unexpected %s from %s", self.me.rank, type(msg).__name__, conn.address)

    async def _on_register(self, conn: ControlConnection, msg: Register) -> None:
        if msg.after_prefill and msg.transfer_id not in self.requests:
            self._drain_inbox()  # a start_request still queued from the framework thread counts
        if msg.transfer_id not in self.requests and msg.transfer_id not in self._released:
            if msg.after_prefill:
                await conn.send(RegisterError(msg.transfer_id, (
                    f"prefill rank {self.me.rank} has no transfer {msg.transfer_id!r} although decode got it from "
                    f"prefill's response: this prefill instance was restarted since (its KV is gone) or the router "
                    f"changed the kv_transfer_params")))
                return
            # Decode registers first (DESIGN.md step 2): keep it until prefill starts the request.
            self._parked[msg.transfer_id].append((conn, msg, time.monotonic()))
            conn.closed.add_done_callback(lambda _f, c=conn, t=msg.transfer_id: self._drop_parked(t, c))
            await conn.send(RegisterAck(msg.transfer_id))
            return
        await self._accept(conn, msg)

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        """Decode still waits for these transfers: their leases run on from now."""
        deadline = time.monotonic() + self.config.lease_s
        for tid in msg.transfer_ids:
            req = self.requests.get(tid)
            if req is not None and req.final:
                req.lease_deadline = max(req.lease_deadline, deadline)

    async def _on_abort(self, conn: ControlConnection, msg: Abort) -> None:
        """Decode gave up: write nothing more there, and answer Stopped once no WRITE to it is in flight."""
        req = self.requests.get(msg.transfer_id)
        self._drop_parked(msg.transfer_id, conn)
        key = peer_key(conn.peer)
        log.info("transfer %s: decode %s aborted: %s", msg.transfer_id, key, msg.reason)
        dest = req.dests.get(key) if req is not None else None
        stopped = Stopped(msg.transfer_id, *self.me.rank)
        if dest is None:
            await self._send_quiet(conn, stopped)  # nothing was ever written there
        else:
            self._stop_dest(req, dest, stopped)
        if req is not None:
            if req.expected is None:
                req.expected = set()
            req.expected.discard(key)
            self._check_finished(req, ok=False)
        elif msg.transfer_id not in self._released:
            self._given_up_by_decode(msg.transfer_id)

    def _given_up_by_decode(self, transfer_id: str) -> None:
        """Decode gave the transfer up before prefill started it (concurrent flow, a client that left at once).
        Remember that, so the request, when it starts, computes without keeping its KV for a decode that will not
        come (otherwise its blocks would wait out the lease)."""
        self._drain_inbox()  # a start already queued by the framework thread counts as started
        req = self.requests.get(transfer_id)
        if req is not None:
            req.expected = set() if req.expected is None else req.expected
            self._check_finished(req, ok=False)
        else:
            self._given_up.add(transfer_id)

    def _drop_parked(self, transfer_id: str, conn: ControlConnection) -> None:
        left = [p for p in self._parked.get(transfer_id, []) if p[0] is not conn]
        if left:
            self._parked[transfer_id] = left
        else:
            self._parked.pop(transfer_id, None)

    async def _accept(self, conn: ControlConnection, reg: Register) -> None:
        key = peer_key(conn.peer)
        try:
            req, dest = self._validate(key, conn, reg)
        except InputError as exc:
            log.warning("refusing registration of %s from decode %s: %s", reg.transfer_id, key, exc)
            await conn.send(RegisterError(reg.transfer_id, str(exc)))
            return
        req.dests[key] = dest
        if req.expected is None:
            req.expected = {(key[0], *r) for r in self._peers[key].accepted.plan.decode.ranks()}
        conn.closed.add_done_callback(lambda f, r=req, k=key: self._dest_gone(r, k, f))
        await conn.send(RegisterAck(reg.transfer_id))
        self._pump(req)

    def _validate(self, key: PeerKey, conn: ControlConnection, reg: Register) -> tuple[SendRequest, Destination]:
        req, peer = self.requests.get(reg.transfer_id), self._peers.get(key)
        layer_routes = validate_registration(req, reg, key, peer.accepted if peer else None, self.me.rank,
                                             self.me.stage, self.me.block_size)
        return req, Destination(key, conn, peer, layer_routes, reg)

    def _dest_gone(self, req: SendRequest, key: PeerKey, closed: asyncio.Future) -> None:
        dest = req.dests.get(key)
        if dest is None or dest.done or self.requests.get(req.transfer_id) is not req:
            return
        log.warning("transfer %s: decode %s went away (%s); dropping it", req.transfer_id, key, closed.result())
        dest.done = True
        req.expected.discard(key)
        self._check_finished(req, ok=False)

    # ---- writes ----------------------------------------------------------------------------------------------
    def _pump(self, req: SendRequest) -> None:
        for dest in req.dests.values():
            if dest.done:
                continue
            # Whatever is ready goes out in ONE write per destination: a per-layer write while layers trickle in
            # during compute, few large writes when the sweep or a late registration releases many layers at
            # once (a NIXL request has a fixed cost, so fewer and larger is faster). At most two writes per
            # destination are in flight; layers that become ready meanwhile batch up behind them.
            if dest.batches_in_flight >= self.config.max_writes_per_destination:
                continue
            # Decode may want fewer tokens than the prompt (vLLM recomputes the last prompt token locally).
            end = dest.register.num_tokens
            batch = [(layer, min(req.ready_tokens.get(layer, 0), end)) for layer in dest.layer_routes
                     if layer not in dest.writing
                     and min(req.ready_tokens.get(layer, 0), end) > max(dest.sent_tokens.get(layer, 0),
                                                                         dest.register.first_token)]
            if batch:
                dest.writing.update(layer for layer, _ in batch)
                dest.batches_in_flight += 1
                self._tasks.spawn(self._write_batch(req, dest, batch))
            self._maybe_complete(req, dest)
        self._check_finished(req)  # e.g. final now, and every destination already done or dropped

    async def _write_batch(self, req: SendRequest, dest: Destination, batch: list[tuple[int, int]]) -> None:
        req.first_write_at = req.first_write_at or time.time()
        during_compute = not req.final
        layers = [layer for layer, _ in batch]
        generation = req.generation
        try:
            descs = await self.writer.write(req, dest, batch, lambda ok, why: self._chunk_answered(req, dest, ok, why))
        except Exception as exc:  # noqa: BLE001 - one destination fails, the rest go on
            self._dest_failed(req, dest, f"WRITE of layers {fold_ranges(layers)} failed: {exc}")
            return
        finally:
            dest.writing.difference_update(layers)
            dest.batches_in_flight -= 1
            if dest.done:  # aborted or failed meanwhile: this may have been the last reader of the blocks
                self._flush_notice(dest)
                self._check_finished(req)
        if generation == req.generation:  # else a restart made what this WRITE read stale: send it again
            for layer, ready in batch:
                dest.sent_tokens[layer] = ready
        dest.bytes_written += descs.nbytes
        dest.descriptors += len(descs)
        self.stats.bytes_sent += descs.nbytes
        if during_compute:
            self.stats.bytes_sent_during_compute += descs.nbytes
        self.stats.descriptors += len(descs)
        self.stats.writes += 1
        if self.requests.get(req.transfer_id) is req:
            self._pump(req)

    def _chunk_answered(self, req: SendRequest, dest: Destination, ok: bool, why: str) -> None:
        """Decode's answer to a staged chunk (connector.engine.staging): a refusal fails this destination."""
        if not ok and not dest.done and self.requests.get(req.transfer_id) is req:
            self._dest_failed(req, dest, f"decode did not take a staged chunk: {why}")
        elif not ok:  # stopped meanwhile (an abort: chunks in flight are dropped), or a refusal after Complete
            log.info("transfer %s: decode %s did not take a staged chunk: %s", req.transfer_id, dest.key, why)
        self._check_finished(req, ok=ok)

    def _dest_failed(self, req: SendRequest, dest: Destination, why: str) -> None:
        log.error("transfer %s to decode %s: %s", req.transfer_id, dest.key, why)
        if not dest.done:
            self._stop_dest(req, dest, Abort(req.transfer_id, f"prefill: {why}"))
        if req.expected is not None:
            req.expected.discard(dest.key)
        self._check_finished(req, ok=False)

    def _stop_dest(self, req: SendRequest, dest: Destination, notice: Any) -> None:
        """No new WRITE to `dest`; tell it `notice` once the ones in flight have completed."""
        dest.done = True
        dest.notice = notice
        self._flush_notice(dest)

    def _flush_notice(self, dest: Destination) -> None:
        if dest.notice is not None and not dest.batches_in_flight:
            notice, dest.notice = dest.notice, None
            self._tasks.spawn(self._send_quiet(dest.conn, notice))

    def _maybe_complete(self, req: SendRequest, dest: Destination) -> None:
        if dest.done or not req.final or dest.writing:
            return
        end = dest.register.num_tokens
        if end > dest.register.first_token and any(dest.sent_tokens.get(layer, 0) < end for layer in dest.layer_routes):
            return
        dest.done = True
        msg = Complete(req.transfer_id, *self.me.rank, dest.bytes_written, dest.descriptors,
                       dest.staged_chunks)
        self._tasks.spawn(self._complete(req, dest, msg))

    async def _complete(self, req: SendRequest, dest: Destination, msg: Complete) -> None:
        await self._send_quiet(dest.conn, msg)
        req.expected.discard(dest.key)
        self._check_finished(req)

    def _check_finished(self, req: SendRequest, ok: bool = True) -> None:
        req.failed |= not ok
        # Staged chunks decode has not answered yet keep the request: a refusal must still fail it.
        if req.expected is not None and not req.expected and req.final \
                and all(d.done and not d.batches_in_flight and not self.writer.unanswered(d, req.transfer_id)
                        for d in req.dests.values()):
            self._release(req, ok=not req.failed,
                          why="some decode ranks failed" if req.failed else "all decode ranks completed")

    def _release(self, req: SendRequest, ok: bool, why: str) -> None:
        if self.requests.pop(req.transfer_id, None) is None:
            return
        self._released.add(req.transfer_id)
        if ok:
            self.stats.sends_ok += 1
        else:
            self.stats.sends_failed += 1
        self.finished_info[req.transfer_id] = FinishedInfo(ok, req.first_write_at)
        log.debug("transfer %s released: %s", req.transfer_id, why)
        if not req.finished.done():
            req.finished.set_result(ok)
        if self.on_finished is not None:
            self.on_finished(req.transfer_id, ok)

    async def _send_quiet(self, conn: ControlConnection, msg: Any) -> None:
        try:
            await conn.send(msg)
        except Exception as exc:  # noqa: BLE001 - the peer is gone; its close callback handles the rest
            log.warning("could not send %s to %s: %s", type(msg).__name__, conn.address, exc)

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for req in list(self.requests.values()):
                if req.final and now > req.lease_deadline:
                    log.warning("%s", lease_expiry_note(req, self.config.lease_s))
                    for dest in req.dests.values():
                        if not dest.done:
                            self._stop_dest(req, dest, Abort(req.transfer_id, "prefill lease expired"))
                    req.expected, req.failed = set(), True
                    self.stats.sends_expired += 1
                    self._check_finished(req, ok=False)  # released once no WRITE is in flight
            for tid, parked in list(self._parked.items()):
                if now - parked[0][2] > self.config.lease_s:
                    del self._parked[tid]
                    why = f"prefill rank {self.me.rank} never started {tid!r} within {self.config.lease_s:.0f} s"
                    for conn, _reg, _at in parked:
                        self._tasks.spawn(self._send_quiet(conn, RegisterError(tid, why)))
            for tid in self._released.expire(now):
                self.finished_info.pop(tid, None)
            self._given_up.expire(now)

    async def wait_finished(self, transfer_id: str, timeout: float) -> bool:
        req = self.requests.get(transfer_id)
        if req is None:
            info = self.finished_info.get(transfer_id)
            return info is not None and info.ok
        async with asyncio.timeout(timeout):
            return await asyncio.shield(req.finished)

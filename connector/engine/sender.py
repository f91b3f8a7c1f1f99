"""Per-layer streaming sender (prefill side). Framework-agnostic asyncio; runs on the process's one event loop.

A request's layers go out as soon as two things are known: the layer is computed (`layer_ready`, or the sweep at
the end of a chunk) and the decode rank's registration (its block ids) has arrived. Whichever comes second
triggers the WRITE, so a registration that arrives after prefill finished is served from the kept blocks (bulk
fallback) by the same code. Every route is keyed by (pool, global layer) from the plan; slots never cross ranks."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from connector.core.descriptors import blocks_moved
from connector.core.errors import CapabilityError, InputError
from connector.core.untrusted import shown, shown_text
from connector.engine.batch_writer import BatchWriter
from connector.engine.config import SenderConfig
from connector.engine.dispatch import Dispatch
from connector.engine.inbox import Inbox
from connector.engine.layer_events import LayerEvents
from connector.engine.ownership import Ownership
from connector.engine.peers import PeerTable
from connector.engine.rank import LocalRank
from connector.engine.sender_state import FinishedInfo, PeerInfo, SendRequest, given_up_note, lease_expiry_note
from connector.engine.stats import SenderStats
from connector.engine.timeline import close
from connector.engine.trim import ParkedTrim
from connector.protocol.handshake import PeerKey
from connector.protocol.messages import (Abort, Heartbeat, Hello, Message, Register, RegisterAck, RegisterError,
                                         Scattered, Stopped)
from connector.transport.base import KVTransport
from connector.transport.connection import ControlConnection
from connector.transport.control import ControlServer
from connector.transport.loop import OwnedTasks

log = logging.getLogger(__name__)


class StreamSender:
    """One prefill rank. Thread-safe entry points (`start_request`, `begin_chunk`, `layer_ready`, `end_chunk`,
    `abort`) return at once and hand the work to the event loop; everything else runs on the loop. Who may act on
    which transfer is connector.engine.ownership's to say, the decode ranks themselves are connector.engine.peers'."""

    def __init__(self, me: LocalRank, transport: KVTransport, config: SenderConfig, loop: asyncio.AbstractEventLoop,
                 on_finished: Callable[[str, bool], None] | None = None) -> None:
        """`transport`: this rank's connector.transport.nixl.Transport, with `me.regions` (and `me.staging`, if
        any) registered. With a staging buffer, decode ranks that have one too get scattered blocks as staged
        chunks (connector.engine.staging), others direct WRITEs (connector.engine.batch_writer chooses)."""
        self.me, self.transport, self.config, self.loop = me, transport, config, loop
        self.on_finished, self.stats = on_finished, SenderStats()
        self.writer = BatchWriter(me, transport, config, self.stats)
        self.ownership = Ownership(config, me.rank, me.stage, me.block_size)
        self.requests: dict[str, SendRequest] = self.ownership.requests
        """Requests started and not released (the ownership's table, read here on every path)."""
        self._tasks = OwnedTasks(f"prefill rank {me.rank}")
        self._server: ControlServer | None = None
        self._inbox = Inbox(loop, f"prefill rank {me.rank}", config.layer_wake_gap_us, config.layer_wake_cpu_share,
                            config.layer_wake_gap_max_us)
        self.hello = me.hello("prefill", transport)
        self._table = PeerTable(transport, self.hello, me.model, me.rank, config)
        self._last_refusal = ""
        """The last decode rank refused at the handshake here, and why (named when a lease expires unread)."""
        self._trim = ParkedTrim()
        self._events: LayerEvents[tuple[SendRequest, int | None, int]] = LayerEvents(
            loop, self._tasks.spawn, lambda ready: self._mark_ready(*ready))
        """Layers waiting for their CUDA event, one wait per loop turn (connector.engine.layer_events)."""
        self._to_pump: dict[str, SendRequest] = {}
        """Requests with layers marked ready this turn, pumped once it ends (`_pump_soon`)."""
        self.dispatch = Dispatch(me, config, self.writer, self.ownership, self.stats, self._tasks, self._inbox,
                                 self._table, lambda tid, ok: self.on_finished and self.on_finished(tid, ok))
        """The destination-and-write half (connector.engine.dispatch): WRITEs, Completes, notices, the release."""

    @property
    def port(self) -> int:
        """The side channel's bound port (after `start()`)."""
        return self._server.port if self._server is not None else self.config.port

    @property
    def peers(self) -> dict[PeerKey, PeerInfo]:
        """Accepted decode ranks on live connections: their plan, regions and NIXL agent name."""
        return self._table.by_key

    def finished_info(self, transfer_id: str) -> FinishedInfo | None:
        """How a released transfer ended, as long as its id is remembered as released (stats, late waiters)."""
        return self.ownership.outcome(transfer_id)

    @property
    def parked_count(self) -> int:
        """Registrations waiting for their request to start."""
        return self.ownership.parked_count

    # ---- lifetime -------------------------------------------------------------------------------------------
    async def start(self) -> int:
        """Start the side-channel server; returns the bound port."""
        self._server = ControlServer(self.hello, self, self.config.side_channel, host=self.config.host,
                                     port=self.config.port)
        await self._server.start()
        self._tasks.spawn(self._lease_loop())
        self._tasks.spawn(self._inbox.run())
        return self._server.port

    async def aclose(self) -> None:
        """Stop every task this sender runs (awaited), close the side channel, forget the decode ranks' agents."""
        await self._tasks.aclose()
        if self._server is not None:
            await self._server.aclose()  # each connection's end releases its peer (agent removed off the loop)
        await self._table.aclose()

    server = property(lambda self: self._server, doc="The side channel's server (after `start()`).")

    # ---- framework-thread entry points (return at once; connector.engine.inbox says which wake the loop) --------
    def start_request(self, transfer_id: str, num_tokens: int, secret: str = "") -> None:
        """`secret`: the transfer's capability (connector.engine.ownership); '': an open transfer."""
        self._inbox.put(self._start_request, transfer_id, num_tokens, secret, wake=True)

    def begin_chunk(self, transfer_id: str, block_ids: list[list[int]], computed_tokens: int) -> None:
        """The next forward computes tokens up to `computed_tokens`, into `block_ids` (per group, from token 0)."""
        self._inbox.put(self._begin_chunk, transfer_id, block_ids, computed_tokens, wake=False)

    def layer_ready(self, transfer_id: str, global_layer: int, event: Any = None) -> None:
        """Layer `global_layer` holds this chunk's tokens (after `event`, a CUDA event, completes)."""
        self._inbox.put_layer(transfer_id, self._layer_ready, global_layer, event)

    def end_chunk(self, transfer_id: str, event: Any = None) -> None:
        """Every layer of this rank holds this chunk's tokens: sends what no `layer_ready` covered (the sweep)."""
        self._inbox.put(self._layer_ready, transfer_id, None, event, wake=True)

    def abort(self, transfer_id: str, reason: str) -> None:
        self._inbox.put(self._abort, transfer_id, reason, wake=True)

    # ---- loop side -------------------------------------------------------------------------------------------
    def _start_request(self, transfer_id: str, num_tokens: int, secret: str = "") -> None:
        if transfer_id in self.requests:
            log.error("transfer %s started twice; ignoring the second start", transfer_id)
            return
        req = SendRequest(transfer_id, num_tokens, [], finished=self.loop.create_future(), secret=secret,
                          loop_cpu_ns=time.thread_time_ns())
        req.points.mark("started")
        for p, refused in self.ownership.start(req, time.monotonic()):
            self._tasks.spawn(self.dispatch.send_quiet(p.conn, self._answer(p.peer, p.register, refused)))
        self.dispatch.note_streaming(req)  # registrations that waited for this start are destinations now
        if req.given_up_by is not None:
            log.info("transfer %s: decode engine %r gave it up before prefill started; its KV is kept only %g s",
                     transfer_id, req.given_up_by, self.config.given_up_keep_s)

    def _begin_chunk(self, transfer_id: str, block_ids: list[list[int]], computed_tokens: int) -> None:
        req = self.requests.get(transfer_id)
        if req is None:
            log.error("begin_chunk for unknown transfer %s", transfer_id)
            return
        moved = blocks_moved(req.block_ids, block_ids, self.me.null_block)
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
        if event is not None:  # (the tokens as of this call: a later begin_chunk in the same drain moves them on)
            self._events.add((req, global_layer, tokens), event)
        else:
            self._mark_ready(req, global_layer, tokens)

    def _mark_ready(self, req: SendRequest, global_layer: int | None, tokens: int) -> None:
        start, end = self.me.stage
        layers = range(start, end) if global_layer is None else (global_layer,)
        for layer in layers:
            req.ready_tokens[layer] = max(req.ready_tokens.get(layer, 0), tokens)
        req.points.mark("first_layer")
        if global_layer is None and tokens >= req.num_tokens:
            self.ownership.all_computed(req, time.monotonic())
            if not req.points.computed:
                req.loop_cpu_ns = time.thread_time_ns() - req.loop_cpu_ns
            req.points.mark("computed")
        self._pump_soon(req)

    def _pump_soon(self, req: SendRequest) -> None:
        """Pump `req` once the loop has run what this turn holds: layers drained together go out as one batch per
        destination, not one WRITE (and its loop work) per layer."""
        if not self._to_pump:
            self.loop.call_soon(self._pump_marked)
        self._to_pump[req.transfer_id] = req

    def _pump_marked(self) -> None:
        marked, self._to_pump = self._to_pump, {}
        for tid, req in marked.items():
            if self.requests.get(tid) is req:
                self.dispatch.pump(req)

    def _abort(self, transfer_id: str, reason: str) -> None:
        self.ownership.drop_parked(transfer_id)
        req = self.requests.get(transfer_id)
        if req is None:
            return
        for dest in req.dests.values():
            if not dest.done:
                self.dispatch.stop_dest(req, dest, Abort(transfer_id, f"prefill aborted: {reason}"))
        # Nothing new is posted; writes already reading the source blocks finish first, so the blocks are only
        # handed back (finished) once nobody reads them, and decode hears of it only once nothing more lands.
        req.all_computed, req.failed, req.expected = True, True, set()
        self.dispatch.check_finished(req, ok=False)

    # ---- the side channel's handler (connector.transport.control.ControlHandler): what decode ranks send, each
    # acting only on what its connection owns (connector.engine.ownership) -----------------------------------------
    def peek(self, hello: Hello) -> None:
        self._table.peek(hello)

    def on_hello(self, peer: Hello) -> Awaitable[PeerInfo]:
        return self._table.admit(peer)

    async def on_message(self, conn: ControlConnection, msg: Message) -> None:
        """Decode rank -> this rank, in order, one method per message."""
        peer: PeerInfo = conn.session
        match msg:
            case Register():
                await self._on_register(conn, peer, msg)
            case Scattered():
                if self.writer.staged is not None:
                    self.writer.staged.on_scattered(conn, msg)  # only chunks sent on this connection wait under it
            case Heartbeat():
                self.ownership.heartbeat(conn, peer.key, msg.transfer_ids, time.monotonic())
            case Abort():
                await self._on_abort(conn, peer, msg)
            case _:
                log.warning("prefill %s: unexpected %s from %s", self.me.rank, type(msg).__name__, conn.address)

    async def _on_register(self, conn: ControlConnection, peer: PeerInfo, msg: Register) -> None:
        tid = msg.transfer_id
        self._inbox.drain()  # a start_request and layer hooks still queued from the framework thread count
        serve = tid in self.requests or tid in self.ownership.released
        try:
            if serve:
                req, _dest = self.ownership.serve(conn, peer, msg, time.monotonic())
            else:
                self.ownership.park(conn, peer, msg, time.monotonic())
        except InputError as exc:
            await self.dispatch.send_quiet(conn, self._answer(peer, msg, exc))
            return
        await self.dispatch.send_quiet(conn, RegisterAck(tid))
        if serve:
            self.dispatch.pump(req)

    def _answer(self, peer: PeerInfo, reg: Register, refused: InputError | None) -> RegisterAck | RegisterError:
        if refused is None:
            return RegisterAck(reg.transfer_id)
        self.stats.capability_refusals += isinstance(refused, CapabilityError)
        log.warning("refusing registration of %s from decode %s: %s", shown(reg.transfer_id), peer.key, refused)
        return RegisterError(reg.transfer_id, str(refused))

    async def _on_abort(self, conn: ControlConnection, peer: PeerInfo, msg: Abort) -> None:
        """Decode gave up: write nothing more there, and answer Stopped once no WRITE to it is in flight. An abort
        of a transfer another engine owns changes nothing (and is answered Stopped: nothing of it goes here)."""
        tid, key = msg.transfer_id, peer.key
        stopped = Stopped(tid, *self.me.rank)
        verdict = self.ownership.abort(conn, key, tid, msg.proof)
        if verdict.foreign_owner is not None or verdict.unproven:
            self.stats.capability_refusals += bool(verdict.unproven)
            log.warning("ignoring abort of %s from decode %s: %s", shown(tid), key, verdict.unproven or
                        f"the transfer belongs to decode engine {verdict.foreign_owner!r}")
            await self.dispatch.send_quiet(conn, stopped)
            return
        log.info("transfer %s: decode %s aborted: %s", shown(tid), key, shown_text(msg.reason))
        if verdict.gives_up:
            # Recorded before Stopped is answered: once decode hears it, prefill may start the request at once (a
            # start the framework thread queued meanwhile counts as started, and the give-up weighs its proof then).
            self._inbox.drain()
            self.ownership.give_up(tid, key[0], time.monotonic(), nonces=conn.nonces, proof=msg.proof)
        if verdict.destination is None:
            await self.dispatch.send_quiet(conn, stopped)  # nothing was ever written there
        else:
            self.dispatch.stop_dest(verdict.request, verdict.destination, stopped)
        if verdict.fails_request:
            self.dispatch.check_finished(verdict.request, ok=False)

    def on_closed(self, conn: ControlConnection) -> None:
        """A decode connection closed (the server calls this once per connection): everything that ran on it ends
        here, its destinations dropped, its staged chunks unanswered, its waiting registrations forgotten."""
        peer: PeerInfo = conn.session
        for req, dest in self.ownership.connection_closed(conn, peer.key):
            log.warning("transfer %s: decode %s went away (%s); dropping it", req.transfer_id, dest.key,
                        conn.close_reason)
            self.dispatch.check_finished(req, ok=False)
        if self.writer.staged is not None:
            self.writer.staged.connection_closed(conn)

    def on_refusal(self, kind: str) -> None:
        """Metrics; a router's start-up probe (connector.core.errors.Probed) is not a refused peer."""
        self.stats.connections_refused += kind != "probe"
        self.stats.auth_failures += kind == "auth"

    def on_refused(self, hello: Hello, reason: str, address: str, came_for: Callable[[str], bool]) -> None:
        """A handshake failed here: the transfer the peer came for (`hello.for_transfer`, or one `came_for` matches:
        a decode that refused our Hello names it as a digest) is given up now (ownership.refused), not at the lease."""
        who = (f"{hello.role} engine {shown(hello.engine_id, quote=True)} rank ({hello.pp_rank},{hello.tp_rank}) "
               f"at {address}" if hello.engine_id else f"a {hello.role} rank at {address}")
        self._last_refusal = f"{who}: {reason}"
        if hello.role != "decode":
            return
        self._inbox.drain()  # a start already queued by the framework thread counts as started
        tid = hello.for_transfer or next((t for t in self.ownership.requests if came_for(t)), "")
        if not tid:
            return
        why = f"{who} was refused at the handshake ({reason})"
        if self.ownership.refused(tid, hello.engine_id, why, time.monotonic()):
            log.warning("transfer %s: %s; its KV is kept %g s more (not the %g s lease) in case another decode "
                        "registers it", shown(tid), why, self.config.given_up_keep_s, self.config.lease_s)

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            # One call per tick, so its locals end with it: a loop variable left in this frame kept the last request
            # it looked at (its destination, closed connection and peer) alive while idle (the soak found it).
            self._lease_tick(time.monotonic())

    def _lease_tick(self, now: float) -> None:
        """Leases run out, registrations wait too long, released ids are forgotten."""
        for req in list(self.requests.values()):
            if req.all_computed and now > req.lease_deadline and req.given_up_by is not None and not req.dests:
                log.log(*given_up_note(req, self.config.given_up_keep_s))
                req.expected = set()
                self.dispatch.check_finished(req, ok=False)
            elif req.all_computed and now > req.lease_deadline:
                log.warning("%s", lease_expiry_note(req, self.config.lease_s, self._last_refusal))
                for dest in req.dests.values():
                    if not dest.done:
                        self.dispatch.stop_dest(req, dest, Abort(req.transfer_id, "prefill lease expired"))
                req.expected, req.failed = set(), True
                self.stats.sends_expired += 1
                self.dispatch.check_finished(req, ok=False)  # released once no WRITE is in flight
        for tid, parked in self.ownership.expired_waits(now):
            why = f"prefill rank {self.me.rank} never started {tid!r} within {self.config.lease_s:.0f} s"
            for p in parked:
                self._tasks.spawn(self.dispatch.send_quiet(p.conn, RegisterError(tid, why)))
        self.ownership.forget_old(now)
        self._trim.after(self.ownership.parked_bytes_dropped, self._tasks.spawn)  # their memory goes back

    async def wait_finished(self, transfer_id: str, timeout: float) -> bool:
        req = self.requests.get(transfer_id)
        if req is None:
            return (info := self.finished_info(transfer_id)) is not None and info.ok
        async with asyncio.timeout(timeout):
            return await asyncio.shield(req.finished)

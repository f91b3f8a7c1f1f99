"""What decode ranks tell a prefill rank (connector.engine.sender): registrations, aborts, heartbeats, staged-chunk
answers. Each acts only on what the connection that sends it owns:

- A transfer id belongs to the decode engine that first registers it (`SendRequest.owner`, or the engine of its
  waiting registrations). A registration from another engine is refused; an abort or heartbeat from another engine
  changes nothing.
- An abort before any registration (decode gave up early) is pinned to the engine that sent it: the request then
  keeps its KV only `given_up_keep_s` after it finished instead of the lease, and a registration from any engine
  within that time is served. So an unrelated peer's abort cannot deny a transfer, and a decode that really gave
  up does not hold prefill's blocks for the lease.
- A destination (decode rank) is the registering connection's own: its block ids, its regions, its NIXL agent.
  Heartbeats extend a lease only for transfers with a destination on that connection.
- Registrations are checked in full before anything is kept; one that waits for its request to start counts against
  its connection's limits (count and memory).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from connector.core.errors import InputError
from connector.engine.sender_state import (Destination, Parked, PeerInfo, SendRequest, check_against_request,
                                          check_registration, parked_cost)
from connector.protocol.messages import (Abort, Heartbeat, Message, Register, RegisterAck, RegisterError, Scattered,
                                         Stopped)
from connector.transport.control import ControlConnection

log = logging.getLogger(__name__)


class InboundMixin:
    """Part of StreamSender: the handlers of decode's messages (see the module docstring)."""

    requests: dict[str, SendRequest]
    _parked: dict[str, list[Parked]]

    async def _on_message(self, conn: ControlConnection, msg: Message) -> None:
        """Decode rank -> this rank, in order, one method per message."""
        peer: PeerInfo = conn.session
        match msg:
            case Register():
                await self._on_register(conn, peer, msg)
            case Scattered():
                if self.writer.staged is not None:
                    self.writer.staged.on_scattered(conn, msg)  # only chunks sent on this connection wait under it
            case Heartbeat():
                self._on_heartbeat(conn, peer, msg)
            case Abort():
                await self._on_abort(conn, peer, msg)
            case _:
                log.warning("prefill %s: unexpected %s from %s", self.me.rank, type(msg).__name__, conn.address)

    def _owner_of(self, transfer_id: str) -> str | None:
        """The decode engine `transfer_id` belongs to, if any has claimed it yet."""
        req = self.requests.get(transfer_id)
        if req is not None and req.owner is not None:
            return req.owner
        parked = self._parked.get(transfer_id)
        return parked[0].peer.key[0] if parked else None

    async def _on_register(self, conn: ControlConnection, peer: PeerInfo, msg: Register) -> None:
        tid = msg.transfer_id
        if tid not in self.requests:
            self._drain_inbox()  # a start_request still queued from the framework thread counts
        if tid in self.requests or tid in self._released:
            await self._accept(conn, peer, msg)
            return
        try:
            if msg.after_prefill:
                raise InputError(
                    f"prefill rank {self.me.rank} has no transfer {tid!r} although decode got it from prefill's "
                    f"response: this prefill instance was restarted since (its KV is gone) or the router changed "
                    f"the kv_transfer_params")
            # Decode registers first (DESIGN.md step 2): keep it until prefill starts the request, once checked.
            check_registration(msg, peer, self.me.rank, self.me.stage, self.me.block_size)
            self._check_owner(tid, peer)
            self._park(conn, peer, msg)
            self._given_up.discard(tid)  # an early abort (maybe another engine's) does not bind this registration
        except InputError as exc:
            log.warning("refusing registration of %s from decode %s: %s", tid, peer.key, exc)
            await conn.send(RegisterError(tid, str(exc)))
            return
        await conn.send(RegisterAck(tid))

    def _check_owner(self, transfer_id: str, peer: PeerInfo) -> None:
        owner = self._owner_of(transfer_id)
        if owner is not None and owner != peer.key[0]:
            raise InputError(f"transfer {transfer_id!r} belongs to decode engine {owner!r} (the first to register or "
                             f"abort it), not to {peer.key[0]!r}: one transfer id is one request of one decode "
                             f"engine; check that the router sends each id to one decode instance")

    def _park(self, conn: ControlConnection, peer: PeerInfo, msg: Register) -> None:
        cost = parked_cost(msg)
        cfg = self.config
        if peer.parked + 1 > cfg.max_parked_per_connection or \
                peer.parked_bytes + cost > cfg.max_parked_bytes_per_connection:
            log.warning("decode %s has %d registrations (%d B) waiting for their requests to start; refusing %s "
                        "(settings max_parked_per_connection=%d, max_parked_bytes_per_connection=%d)", peer.key,
                        peer.parked, peer.parked_bytes, msg.transfer_id, cfg.max_parked_per_connection,
                        cfg.max_parked_bytes_per_connection)
            raise InputError(f"decode rank {peer.key[1:]} already has {peer.parked} registrations ({peer.parked_bytes} "
                             f"B) waiting for prefill to start their requests, the most one connection may (settings "
                             f"max_parked_per_connection, max_parked_bytes_per_connection)")
        peer.parked += 1
        peer.parked_bytes += cost
        self._parked.setdefault(msg.transfer_id, []).append(Parked(conn, peer, msg, time.monotonic(), cost))
        conn.closed.add_done_callback(lambda _f, c=conn, t=msg.transfer_id: self._drop_parked(t, c))

    def _drop_parked(self, transfer_id: str, conn: ControlConnection | None = None) -> list[Parked]:
        """Forget the waiting registrations of `transfer_id` (those of `conn` only, if given); returns them."""
        entries = self._parked.pop(transfer_id, [])
        keep = [p for p in entries if conn is not None and p.conn is not conn]
        if keep:
            self._parked[transfer_id] = keep
        dropped = [p for p in entries if p not in keep]
        for p in dropped:
            p.peer.parked -= 1
            p.peer.parked_bytes -= p.cost
        return dropped

    def _on_heartbeat(self, conn: ControlConnection, peer: PeerInfo, msg: Heartbeat) -> None:
        """Decode still waits for these transfers: the leases of those it registered on this connection run on."""
        deadline = time.monotonic() + self.config.lease_s
        for tid in msg.transfer_ids:
            req = self.requests.get(tid)
            dest = req.dests.get(peer.key) if req is not None else None
            if dest is not None and dest.conn is conn and req.final:
                req.lease_deadline = max(req.lease_deadline, deadline)

    async def _on_abort(self, conn: ControlConnection, peer: PeerInfo, msg: Abort) -> None:
        """Decode gave up: write nothing more there, and answer Stopped once no WRITE to it is in flight. An abort
        of a transfer another engine owns changes nothing (and is answered Stopped: nothing of it goes here)."""
        tid, key = msg.transfer_id, peer.key
        self._drop_parked(tid, conn)
        stopped = Stopped(tid, *self.me.rank)
        owner = self._owner_of(tid)
        if owner is not None and owner != key[0]:
            log.warning("ignoring abort of %s from decode %s: the transfer belongs to decode engine %r", tid, key,
                        owner)
            await self._send_quiet(conn, stopped)
            return
        log.info("transfer %s: decode %s aborted: %s", tid, key, msg.reason)
        req = self.requests.get(tid)
        dest = req.dests.get(key) if req is not None else None
        if dest is None:
            await self._send_quiet(conn, stopped)  # nothing was ever written there
        else:
            # Answer where asked: after losing a connection (a cut link) decode asks again over a new one, and must
            # hear Stopped only once no WRITE to it is in flight. The identity is this connection's alone (a second
            # live claim is refused), so the old connection is gone and the asker is that decode rank.
            dest.conn = conn
            self._stop_dest(req, dest, stopped)
        if req is not None and req.owner is not None:
            req.expected.discard(key)
            self._check_finished(req, ok=False)
        elif tid not in self._released:
            self._given_up_by_decode(tid, key[0])

    def _given_up_by_decode(self, transfer_id: str, engine: str) -> None:
        """Decode gave the transfer up before registering it (concurrent flow, a client that left at once).
        Remember that, pinned to the engine that said so: the request (now or when it starts) keeps its KV only
        `given_up_keep_s` after it finished, not for the lease, unless some engine registers it meanwhile."""
        self._drain_inbox()  # a start already queued by the framework thread counts as started
        req = self.requests.get(transfer_id)
        if req is None:
            self._given_up.add(transfer_id, engine)
            return
        req.given_up_by = engine
        if req.final:
            req.lease_deadline = min(req.lease_deadline, time.monotonic() + self.config.given_up_keep_s)

    async def _accept(self, conn: ControlConnection, peer: PeerInfo, reg: Register) -> None:
        key = peer.key
        req = self.requests.get(reg.transfer_id)
        try:
            if conn.is_closed:
                raise InputError(f"decode rank {key} closed its connection")
            check_against_request(req, reg, key, self.me.rank)
            self._check_owner(reg.transfer_id, peer)
            check_registration(reg, peer, self.me.rank, self.me.stage, self.me.block_size)
        except InputError as exc:
            log.warning("refusing registration of %s from decode %s: %s", reg.transfer_id, key, exc)
            await self._send_quiet(conn, RegisterError(reg.transfer_id, str(exc)))
            return
        req.owner = key[0]
        if req.given_up_by is not None:  # some engine gave it up early; this registration is served all the same
            req.given_up_by = None
            if req.final:
                req.lease_deadline = time.monotonic() + self.config.lease_s
        req.dests[key] = Destination(key, conn, peer, peer.layer_routes, reg)
        if req.expected is None:
            req.expected = {(key[0], *r) for r in peer.accepted.plan.decode.ranks()}
        conn.closed.add_done_callback(lambda f, r=req, k=key: self._dest_gone(r, k, f))
        await self._send_quiet(conn, RegisterAck(reg.transfer_id))
        self._pump(req)

    def _dest_gone(self, req: SendRequest, key: Any, closed: asyncio.Future) -> None:
        dest = req.dests.get(key)
        if dest is None or dest.done or self.requests.get(req.transfer_id) is not req:
            return
        log.warning("transfer %s: decode %s went away (%s); dropping it", req.transfer_id, key, closed.result())
        dest.done = True
        req.expected.discard(key)
        self._check_finished(req, ok=False)

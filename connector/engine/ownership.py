"""Who owns which transfer on a prefill rank: the rules, as one object with no I/O that the sender
(connector.engine.sender) asks before it answers decode or writes anything.

- A transfer started with a secret (`SendRequest.secret`, the capability of kv_transfer_params) is served only to a
  registration that proves it on its own connection (connector.protocol.auth.transfer_proof); a wrong or missing
  proof is refused (CapabilityError), whoever registered first, so knowing a transfer id buys a token holder
  nothing. Registrations with a proof wait for the request whatever else waits (the proof is checked when it
  starts); an Abort from a decode rank with no destination of the transfer on its connection counts only with a
  valid proof.
- A transfer id belongs to the decode engine that first registers it (`SendRequest.owner`, or the engine of its
  waiting registrations without a proof). A registration from another engine is refused; an abort or heartbeat from
  another engine changes nothing. For an open transfer (no secret) this is all there is.
- An abort before any registration (decode gave up early) is pinned to the engine that sent it: the request then
  keeps its KV only `given_up_keep_s` after it was computed instead of the lease, and a registration from any
  engine within that time is served. So an unrelated peer's abort cannot deny a transfer, and a decode that really
  gave up does not hold prefill's blocks for the lease. For a transfer with a secret only a give-up that proves it
  counts: one that came before the request started is kept with its connection's nonces and proof and weighed when
  the request starts with its secret (`EarlyGiveUp`), so a token holder's early abort cannot shorten the victim's
  lease either.
- A destination (decode rank) is the registering connection's own: its block ids, its regions, its NIXL agent.
  Heartbeats extend a lease only for transfers with a destination on that connection.
- A decode rank refused at the handshake (another model, another token) cannot register, so the transfer its
  first Hello named is given up the same way, with the reason; unauthenticated, so only while no engine owns the
  transfer, and a registration within `given_up_keep_s` is still served.
- Registrations are checked in full before anything is kept; one that waits for its request to start counts against
  its connection's limits and those of all connections together (count and memory), and waits at most the lease.
- What a connection holds here (its destinations, its waiting registrations) ends with it, in one sweep when it
  closes (`connection_closed`), the way httpcore's pool sweeps its closed connections. Nothing is hooked on the
  connection per transfer: a connection lives as long as heartbeats keep it open, and a callback per transfer kept
  every finished SendRequest alive for that long (measured: 40 transfers over one connection, 40 requests kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from connector.core.errors import CapabilityError, InputError, RegistrationError
from connector.engine.config import SenderConfig
from connector.engine.sender_state import (Destination, Parked, PeerInfo, RecentIds, SendRequest,
                                          check_against_request, check_registration)
from connector.protocol.auth import check_transfer_proof
from connector.protocol.handshake import PeerKey
from connector.protocol.messages import Register


@dataclass(frozen=True)
class EarlyGiveUp:
    """A give-up that came before its request started: who, why, and what proves it (empty for a handshake
    refusal, which is unauthenticated) on the connection with `nonces`."""

    engine: str
    why: str = ""
    nonces: bytes = b""
    proof: bytes = b""

    def holds_for(self, req: SendRequest) -> bool:
        """Whether it counts for `req`: always for an open transfer, only with a valid proof for one with a secret."""
        return not req.secret or not check_transfer_proof(req.secret, self.nonces, req.transfer_id, self.proof)


MAX_EARLY_GIVE_UPS = 8
"""Kept per transfer id, the latest: a token holder's unproven give-ups cannot push out the real decode's proven one
unless it sends this many after it (then the transfer only keeps its KV for the lease)."""


@dataclass(frozen=True)
class AbortVerdict:
    """What a decode rank's Abort of a transfer comes to (`Ownership.abort`)."""

    foreign_owner: str | None = None
    """The transfer belongs to this other decode engine: the abort changes nothing (it is answered Stopped)."""
    request: SendRequest | None = None
    """The request, if prefill has started it."""
    destination: Destination | None = None
    """That decode rank's destination, now on the asking connection: stop it (Stopped once nothing is in flight).
    None: nothing was ever written there (answer Stopped at once)."""
    fails_request: bool = False
    """The request's owner gave up a destination: the request fails once its other destinations are done."""
    gives_up: bool = False
    """Nobody has registered the transfer yet: pin the give-up to the asking engine (`given_up`)."""
    unproven: str = ""
    """The transfer has a secret and this Abort (from a rank with no destination of it here) does not prove it:
    it changes nothing (answered Stopped; counted as a capability refusal)."""


class Ownership:
    """The sender's transfers and the rules of who may act on them (see the module docstring). No I/O and no
    clock: callers pass `now` (time.monotonic()) where a rule needs one, and send whatever answer it implies."""

    def __init__(self, config: SenderConfig, rank: tuple[int, int], stage: tuple[int, int], block_size: int) -> None:
        self.config, self.rank, self.stage, self.block_size = config, rank, stage, block_size
        self.requests: dict[str, SendRequest] = {}
        """Requests prefill has started and not released, by transfer id."""
        self.parked: dict[str, list[Parked]] = {}
        """Registrations that came before their request started, by transfer id (all of one decode engine)."""
        self.parked_bytes = 0
        """What they hold (bounded in all by max_parked_bytes, as their count is by max_parked)."""
        self.parked_bytes_dropped = 0
        """What the registrations that waited and went (served, refused, expired, closed) held, in all."""
        self.released = RecentIds(config.released_memory_s)
        """Transfers released lately -> how they ended (the sender's FinishedInfo): a late registration for one is
        refused clearly, a late waiter hears the outcome. One table, so the outcome goes when the id does, also when
        `max_ids` pushes the oldest out (a second table pruned by `expire` kept those forever: the soak found it)."""
        self.given_up = RecentIds(config.released_memory_s)
        """Transfers decode aborted before prefill started them -> their EarlyGiveUps, oldest first."""

    @property
    def parked_count(self) -> int:
        return sum(len(entries) for entries in self.parked.values())

    # ---- who owns it --------------------------------------------------------------------------------------------
    def owner_of(self, transfer_id: str) -> str | None:
        """The decode engine `transfer_id` belongs to, if any has claimed it yet."""
        req = self.requests.get(transfer_id)
        if req is not None and req.owner is not None:
            return req.owner
        parked = [p for p in self.parked.get(transfer_id, ()) if not p.register.proof]  # a proof decides later
        return parked[0].peer.key[0] if parked else None

    def check_owner(self, transfer_id: str, engine: str) -> None:
        owner = self.owner_of(transfer_id)
        if owner is not None and owner != engine:
            raise RegistrationError(f"transfer {transfer_id!r} belongs to decode engine {owner!r} (the first to "
                                    f"register or abort it), not to {engine!r}: one transfer id is one request of one "
                                    f"decode engine; check that the router sends each id to one decode instance")

    def lease_of(self, req: SendRequest) -> float:
        """How long a computed request keeps its KV: the lease, or, if decode gave it up before registering, only
        as long as a registration from another decode engine may still come."""
        return self.config.given_up_keep_s if req.given_up_by is not None else self.config.lease_s

    # ---- requests -----------------------------------------------------------------------------------------------
    def start(self, req: SendRequest, now: float) -> list[tuple[Parked, InputError | None]]:
        """Prefill started `req` (its id not in `requests`); a give-up that came first is pinned to it. The
        registrations that waited for it are served here, before any other can come between (one from another
        engine would claim the transfer; an abort would find nothing to stop and be answered Stopped while
        prefill was about to write): returns each with its refusal, if it got one."""
        self.requests[req.transfer_id] = req
        early = [g for g in self.given_up.get(req.transfer_id) or () if g.holds_for(req)]
        req.given_up_by, req.given_up_why = (early[-1].engine, early[-1].why) if early else (None, "")
        self.given_up.discard(req.transfer_id)
        served = []
        for p in self.drop_parked(req.transfer_id):
            try:
                self.serve(p.conn, p.peer, p.register, now)
                served.append((p, None))
            except InputError as exc:
                served.append((p, exc))
        return served

    def all_computed(self, req: SendRequest, now: float) -> None:
        """Prefill computed every token of `req`: its lease starts."""
        req.all_computed = True
        req.lease_deadline = now + self.lease_of(req)

    def release(self, req: SendRequest, now: float, outcome: Any = None) -> bool:
        """Forget `req`, remembering its id (with `outcome`) a while; False if it was released already."""
        if self.requests.get(req.transfer_id) is not req:
            return False
        del self.requests[req.transfer_id]
        self.released.add(req.transfer_id, now, outcome)
        return True

    def outcome(self, transfer_id: str) -> Any:
        """What `release` remembered of a released transfer (None once its id is forgotten, or never released)."""
        return self.released.get(transfer_id)

    def forget_old(self, now: float) -> list[str]:
        """Forget ids older than `released_memory_s`; returns the released ones forgotten."""
        self.given_up.expire(now)
        return self.released.expire(now)

    # ---- registrations -------------------------------------------------------------------------------------------
    def park(self, conn: Any, peer: PeerInfo, reg: Register, now: float) -> None:
        """Keep a registration for a request prefill has not started, once checked (raises InputError)."""
        tid = reg.transfer_id
        if reg.after_prefill:
            raise RegistrationError(
                f"prefill rank {self.rank} has no transfer {tid!r} although decode got it from prefill's response: "
                f"this prefill instance was restarted since (its KV is gone) or the router changed the "
                f"kv_transfer_params")
        # Decode registers first (docs/architecture.md, "One request, prefill side"): kept until prefill starts it.
        check_registration(reg, peer, self.rank, self.stage, self.block_size)
        if not reg.proof:  # one with a proof waits whoever came first: the proof decides when the request starts
            self.check_owner(tid, peer.key[0])
        parked, cfg = Parked.of(conn, peer, reg, now), self.config
        cost = parked.cost
        if peer.parked + 1 > cfg.max_parked_per_connection or \
                peer.parked_bytes + cost > cfg.max_parked_bytes_per_connection:
            raise RegistrationError(
                f"decode rank {peer.key[1:]} already has {peer.parked} registrations ({peer.parked_bytes} B) waiting "
                f"for prefill to start their requests, the most one connection may (settings "
                f"limits.max_parked_per_connection={cfg.max_parked_per_connection}, "
                f"limits.max_parked_bytes_per_connection={cfg.max_parked_bytes_per_connection})")
        if self.parked_count + 1 > cfg.max_parked or self.parked_bytes + cost > cfg.max_parked_bytes:
            raise RegistrationError(
                f"prefill rank {self.rank} already has {self.parked_count} registrations ({self.parked_bytes} B) "
                f"of all decode connections waiting for prefill to start their requests, the most it keeps "
                f"(settings limits.max_parked={cfg.max_parked}, limits.max_parked_bytes={cfg.max_parked_bytes}); raise them if "
                f"this many requests really queue on prefill")
        peer.parked += 1
        peer.parked_bytes += cost
        self.parked_bytes += cost
        self.parked.setdefault(tid, []).append(parked)
        self.given_up.discard(tid)  # an early abort (maybe another engine's) does not bind this registration

    def serve(self, conn: Any, peer: PeerInfo, reg: Register, now: float) -> tuple[SendRequest, Destination]:
        """Make the registering decode rank a destination of its started request, once checked (raises
        InputError); returns both."""
        req = self.requests.get(reg.transfer_id)
        if conn.is_closed:  # its sweep may have run already: nothing added now would ever be swept
            raise RegistrationError(f"decode rank {peer.key} closed its connection")
        check_against_request(req, reg, peer.key, self.rank, peer.states)
        if req.secret:  # before ownership: the capability decides, not who came first
            problem = check_transfer_proof(req.secret, getattr(conn, "nonces", b""), reg.transfer_id, reg.proof)
            if problem:
                raise CapabilityError(problem)
        self.check_owner(reg.transfer_id, peer.key[0])
        check_registration(reg, peer, self.rank, self.stage, self.block_size)
        req.owner = peer.key[0]
        if req.given_up_by is not None:  # some engine gave it up early; this registration is served all the same
            req.given_up_by, req.given_up_why = None, ""
            if req.all_computed:
                req.lease_deadline = now + self.config.lease_s
        dest = req.dests[peer.key] = Destination(peer.key, conn, peer, peer.layer_routes, reg)
        if req.expected is None:
            req.expected = {(peer.key[0], *r) for r in peer.accepted.plan.decode.ranks()}
        return req, dest

    def drop_parked(self, transfer_id: str, conn: Any = None) -> list[Parked]:
        """Forget the waiting registrations of `transfer_id` (those of `conn` only, if given); returns them."""
        entries = self.parked.pop(transfer_id, [])
        keep = [p for p in entries if conn is not None and p.conn is not conn]
        if keep:
            self.parked[transfer_id] = keep
        dropped = [p for p in entries if p not in keep]
        for p in dropped:
            p.peer.parked -= 1
            p.peer.parked_bytes -= p.cost
            self.parked_bytes -= p.cost
            self.parked_bytes_dropped += p.cost
        return dropped

    def expired_waits(self, now: float) -> list[tuple[str, list[Parked]]]:
        """Drop (and return) the registrations whose request has not started within the lease."""
        old = [tid for tid, entries in self.parked.items() if now - entries[0].at > self.config.lease_s]
        return [(tid, self.drop_parked(tid)) for tid in old]

    # ---- heartbeats and aborts -----------------------------------------------------------------------------------
    def heartbeat(self, conn: Any, key: PeerKey, transfer_ids: list[str], now: float) -> None:
        """Decode still waits for these transfers: the leases of those it registered on `conn` run on."""
        deadline = now + self.config.lease_s
        for tid in transfer_ids:
            req = self.requests.get(tid)
            dest = req.dests.get(key) if req is not None else None
            if dest is not None and dest.conn is conn and req.all_computed:
                req.lease_deadline = max(req.lease_deadline, deadline)

    def abort(self, conn: Any, key: PeerKey, transfer_id: str, proof: bytes = b"") -> AbortVerdict:
        """Decode rank `key` gave `transfer_id` up, on `conn` (with `proof` of the transfer's secret, if it has it):
        its waiting registrations go at once, the rest is in the verdict."""
        self.drop_parked(transfer_id, conn)
        owner = self.owner_of(transfer_id)
        if owner is not None and owner != key[0]:
            return AbortVerdict(foreign_owner=owner)
        req = self.requests.get(transfer_id)
        dest = req.dests.get(key) if req is not None else None
        if req is not None and req.secret and dest is None:
            # No destination here: only the capability says this rank is the request's decode (a token holder
            # claiming the owner's engine id at another rank must not fail the transfer, nor shorten its lease).
            problem = check_transfer_proof(req.secret, getattr(conn, "nonces", b""), transfer_id, proof)
            if problem:
                return AbortVerdict(request=req, unproven=problem.replace("registration", "abort"))
        if dest is not None:
            # Answer where asked: after losing a connection (a cut link) decode asks again over a new one, and must
            # hear Stopped only once no WRITE to it is in flight. The identity is this connection's alone (a second
            # live claim is refused), so the old connection is gone and the asker is that decode rank.
            dest.conn = conn
        if req is not None and req.owner is not None:
            req.expected.discard(key)
            return AbortVerdict(request=req, destination=dest, fails_request=True)
        return AbortVerdict(request=req, destination=dest, gives_up=transfer_id not in self.released)

    def give_up(self, transfer_id: str, engine: str, now: float, why: str = "", nonces: bytes = b"",
                proof: bytes = b"") -> None:
        """`engine` gave the transfer up before registering it (concurrent flow, a client that left at once; `why`:
        it was refused at the handshake; `proof` of the transfer's secret on the connection with `nonces`, if it
        sent one): remembered, pinned to that engine; a request (now or when it starts) keeps its KV only
        `given_up_keep_s` after it was computed, not for the lease, unless some engine registers it meanwhile. A
        started request with a secret was checked by `abort`; one that starts later weighs the proof then."""
        req, give_up = self.requests.get(transfer_id), EarlyGiveUp(engine, why, nonces, proof)
        if req is None:
            early = [*(self.given_up.get(transfer_id) or ()), give_up]
            self.given_up.add(transfer_id, now, early[-MAX_EARLY_GIVE_UPS:])
            return
        if not give_up.holds_for(req):  # it started (with its secret) after `abort` weighed the give-up
            return
        req.given_up_by, req.given_up_why = engine, why
        if req.all_computed:
            req.lease_deadline = min(req.lease_deadline, now + self.config.given_up_keep_s)

    def refused(self, transfer_id: str, engine: str, why: str, now: float) -> bool:
        """A decode rank claiming to be of `engine`, whose first Hello named `transfer_id`, was refused at the
        handshake (`why`): it will never register, so the transfer is given up (`give_up`) unless some engine owns
        it already or it was released. The claim is not authenticated (the handshake failed): it weighs no more
        than an early abort. True if it gave the transfer up."""
        if self.owner_of(transfer_id) is not None or transfer_id in self.released:
            return False
        req = self.requests.get(transfer_id)
        if req is not None and req.secret:  # only its decode's proof may shorten its lease, and this one has none
            return False
        self.give_up(transfer_id, engine, now, why)
        return True

    # ---- connections -----------------------------------------------------------------------------------------------
    def connection_closed(self, conn: Any, key: PeerKey) -> list[tuple[SendRequest, Destination]]:
        """Decode rank `key`'s connection `conn` closed: its waiting registrations are dropped, and its
        destinations still being written are marked done and returned (their requests fail there)."""
        for tid in [tid for tid, entries in self.parked.items() if any(p.conn is conn for p in entries)]:
            self.drop_parked(tid, conn)
        gone = []
        for req in self.requests.values():
            dest = req.dests.get(key)
            if dest is not None and dest.conn is conn and not dest.done:
                dest.done = True
                req.expected.discard(key)
                gone.append((req, dest))
        return gone

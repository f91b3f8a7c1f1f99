"""Who may hold what on one side-channel server before and after authentication (connector.transport.limits has the
numbers). Asyncio, on the server's event loop; no I/O of its own: evicting a connection is a callback its owner
gave (which aborts the socket).

Why it is shaped like this. A connection that has not authenticated is anyone's: it must not be able to keep an
authenticated decode out. So
- every connection is counted from accept (TLS not started yet included), per source address and in all;
- connections not yet authenticated ("pending") have their own small budget per address and in all, and a full
  budget does not refuse the newcomer: it evicts the oldest pending connection (of the newcomer's address, or of the
  address holding most), so squatting on the budget with idle sockets, unfinished Hellos or silent TLS sessions
  buys nothing;
- a pending connection whose Hello claims an identity (engine id, pp rank, tp rank) that authenticated from the same
  address before is "known": it leaves that budget for a lane of its own (a few claims per identity, newest kept),
  which arrivals of unknown connections never evict;
- failed proofs count per (address, claimed identity), so a guesser on a decode's host locks out only the identity
  it claims; an identity known to have authenticated is never locked out (its failed attempts are still answered
  late), else claiming it with wrong proofs would lock the real decode out;
- with every one of `max_connections` taken, the address holding the most gives up one of its connections to a
  newcomer from an address holding fewer (by two or more): a pending one, else an authenticated one its owner says
  may go (on prefill: one that was never written to, least recently active first; a decode that received KV here is
  never closed for it). So a peer holding the token on a few addresses cannot keep a decode from another address
  out; it would need about `max_connections` addresses of its own."""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

from connector.transport.limits import ServerLimits

Identity = tuple[str, int, int]
"""(engine_id, pp_rank, tp_rank) as a Hello claims it."""
KNOWN_CLAIMS_PER_IDENTITY = 2
"""Pending connections at once claiming one known identity from one address (a reconnecting rank needs one; a
newer claim evicts the oldest, so a claimant that never proves cannot hold the lane)."""


@dataclass(eq=False)
class Pending:
    """One connection that has not authenticated yet."""

    host: str
    evict: Callable[[str], None]
    """Closes the connection at once, with the reason (its handler then ends)."""
    accepted_at: float = field(default_factory=time.monotonic)
    identity: Identity | None = None
    """What its Hello claims, once read."""
    known: bool = False
    """Its claim is an identity that authenticated from this address before (connector.transport.admission)."""
    evicted: str | None = None
    """Why it was evicted, if it was."""


class AdmissionGuard:
    """Counts connections per source address from accept, keeps the budget of pending (unauthenticated)
    connections, remembers identities that authenticated, and counts failed proofs per (address, identity)."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.open: dict[str, int] = defaultdict(int)
        """Open connections per source host, from accept (pending and authenticated)."""
        self._pending: dict[str, list[Pending]] = {}
        """Unknown pending connections per host, oldest first."""
        self._known_claims: dict[tuple[str, Identity], list[Pending]] = {}
        """Pending connections claiming a known identity, per (host, identity), oldest first."""
        self._known: OrderedDict[tuple[str, Identity], None] = OrderedDict()
        """(host, identity) pairs that authenticated, least recently first (bounded: limits.known_identities)."""
        self._failures: dict[tuple[str, Identity], deque[float]] = {}
        self.evictions = 0
        """Authenticated connections closed for a newcomer's fair share (`admit`)."""

    # ---- counts ---------------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return sum(self.open.values())

    @property
    def handshakes(self) -> int:
        """Pending connections, known claims included."""
        return self.pending_unknown + sum(len(v) for v in self._known_claims.values())

    @property
    def pending_unknown(self) -> int:
        return sum(len(v) for v in self._pending.values())

    # ---- accept ---------------------------------------------------------------------------------------------
    def admit(self, host: str, evictable: Callable[[str], list[Callable[[str], None]]] | None = None) -> str | None:
        """None (and the connection counted) if a connection from `host` may be accepted at all, else why not.
        Only connections in all and per address are checked here: the pending budget evicts (`begin`). With
        `max_connections` open, a newcomer from an address holding fewer than the address holding most (by two or
        more) takes the place of one of that address's connections (`_make_room`): its oldest pending one, else
        the first of `evictable(address)` (authenticated ones that may go, least recently active first)."""
        lim = self.limits
        if self.open.get(host, 0) >= lim.max_connections_per_host:
            return f"{host} has {self.open[host]} connections open (setting limits.max_connections_per_host)"
        if self.total >= lim.max_connections and (refused := self._make_room(host, evictable)) is not None:
            return refused
        self.open[host] += 1
        return None

    def _make_room(self, host: str, evictable: Callable[[str], list[Callable[[str], None]]] | None) -> str | None:
        """Fair shares across source addresses: see `admit`. None if a connection was evicted for `host`'s."""
        lim = self.limits
        full = f"{lim.max_connections} connections are open (setting limits.max_connections)"
        biggest = max(self.open, key=self.open.__getitem__)
        mine, most = self.open.get(host, 0), self.open[biggest]
        if mine + 1 >= most:
            return f"{full} and {host} holds {mine} of them, no fewer than any other address"
        why = (f"{full}: {biggest} holds the most ({most}) and a connection from {host}, which holds {mine}, takes "
               f"the place of one of them")
        pending = self._pending.get(biggest)
        if pending:
            self._evict(pending[0], why)
            return None
        for close in evictable(biggest) if evictable is not None else ():
            close(why)
            self.evictions += 1
            return None
        return f"{full}, and none of those of {biggest}, which holds the most, may be closed for it"

    def release(self, host: str) -> None:
        self.open[host] -= 1
        if self.open[host] <= 0:
            del self.open[host]

    def begin(self, host: str, evict: Callable[[str], None]) -> Pending:
        """A connection admitted by `admit` starts its handshake: it joins the pending budget, evicting the oldest
        pending connection of its own address (that address's budget is full) or of the address holding most (the
        budget in all is full)."""
        lim = self.limits
        mine = self._pending.setdefault(host, [])
        if len(mine) >= lim.max_handshakes_per_host:
            self._evict(mine[0], f"{host} has {len(mine)} connections not yet authenticated and a newer one arrived "
                                 f"(setting limits.max_handshakes_per_host)")
        elif self.pending_unknown >= lim.max_handshakes:
            most = max(self._pending.values(), key=len)
            self._evict(most[0], f"{lim.max_handshakes} connections are not yet authenticated and a newer one "
                                 f"arrived (setting limits.max_handshakes)")
        entry = Pending(host, evict)
        self._pending.setdefault(host, []).append(entry)
        return entry

    def claimed(self, entry: Pending, identity: Identity) -> str | None:
        """The connection's Hello claims `identity` (it passed the Hello checks): None, or why it is refused (that
        identity is locked out at this address). A known identity moves to its own lane."""
        entry.identity = identity
        key = (entry.host, identity)
        if key not in self._known:
            if self.locked_out(entry.host, identity):
                lim = self.limits
                return (f"{entry.host} failed authentication as {_who(identity)} {lim.max_auth_failures} times within "
                        f"{lim.auth_failure_window_s:g} s (setting limits.max_auth_failures); such connections are closed "
                        f"until that window has passed")
            return None
        self._known.move_to_end(key)
        self._drop(entry)
        entry.known = True
        claims = self._known_claims.setdefault(key, [])
        if len(claims) >= KNOWN_CLAIMS_PER_IDENTITY:
            self._evict(claims[0], f"a newer connection claims {_who(identity)} from {entry.host}")
        self._known_claims.setdefault(key, []).append(entry)
        return None

    def authenticated(self, entry: Pending) -> None:
        """The connection's proof checked out: it leaves the pending budget and its identity is known from now."""
        self._drop(entry)
        if entry.identity is not None:
            key = (entry.host, entry.identity)
            self._known[key] = None
            self._known.move_to_end(key)
            while len(self._known) > self.limits.known_identities:
                self._known.popitem(last=False)

    def done(self, entry: Pending) -> None:
        """The handshake ended (either way); idempotent."""
        self._drop(entry)

    def _evict(self, victim: Pending, reason: str) -> None:
        self._drop(victim)
        victim.evicted = reason
        victim.evict(reason)

    def _drop(self, entry: Pending) -> None:
        if entry.known and entry.identity is not None:
            key = (entry.host, entry.identity)
            claims = self._known_claims.get(key, [])
            if entry in claims:
                claims.remove(entry)
            if not claims:
                self._known_claims.pop(key, None)
            return
        mine = self._pending.get(entry.host)
        if mine is not None and entry in mine:
            mine.remove(entry)
            if not mine:
                del self._pending[entry.host]

    # ---- failed proofs --------------------------------------------------------------------------------------
    def auth_failed(self, host: str, identity: Identity) -> None:
        self._failures.setdefault((host, identity), deque()).append(time.monotonic())
        if len(self._failures) > 4096:  # many offending claims: forget those whose window has passed
            for key in list(self._failures):
                self._recent_failures(key)

    def is_known(self, host: str, identity: Identity) -> bool:
        return (host, identity) in self._known

    def locked_out(self, host: str, identity: Identity) -> bool:
        """Too many failed proofs claiming `identity` from `host` (never for a known identity: see the module)."""
        if (host, identity) in self._known:
            return False
        return self._recent_failures((host, identity)) >= self.limits.max_auth_failures

    def _recent_failures(self, key: tuple[str, Identity]) -> int:
        """Failures of `key` within the window; older ones (and keys left with none) are forgotten."""
        times = self._failures.get(key)
        if times is None:
            return 0
        horizon = time.monotonic() - self.limits.auth_failure_window_s
        while times and times[0] < horizon:
            times.popleft()
        if not times:
            del self._failures[key]
        return len(times)


def _who(identity: Identity) -> str:
    engine, pp, tp = identity
    if engine.startswith("lane:"):  # a decode's opening names no engine, only its lane (protocol.auth.lane_tag)
        return f"the decode rank of lane tag {engine[5:17]}"
    return f"engine {engine!r} rank ({pp},{tp})"

"""The decode ranks a prefill rank serves, one per live side-channel connection.

An identity (engine id, pp, tp) and a NIXL agent name belong to one live connection: a second claim waits a moment
for the first connection to end (a restarted rank reconnecting before its old connection was noticed closed) and is
refused if it does not. A peer's NIXL agent is used for its own connection only; when that connection ends, once no
WRITE to it is in flight, its entry goes and its agent is handed back to connector.engine.agents, which keeps it
loaded (idle, never written) for a reconnect, within its bounds (per engine, per source address, in all). So
nothing here grows with peers that came and went, and a peer reconnecting costs no NIXL load (NIXL 1.5.1 leaks
sockets on each unload).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Callable

import msgspec

from connector.core.errors import PeerRefused
from connector.core.layout import ModelLayout
from connector.core.plan import Rank, Route
from connector.engine.agents import LoadedAgents
from connector.engine.config import SenderConfig
from connector.engine.plans import PlanCache
from connector.protocol.handshake import AcceptedPeer, PeerKey, accept_peer, check_peer_layout, peer_key
from connector.protocol.auth import engine_name
from connector.protocol.messages import Error, Hello
from connector.transport.base import KVTransport
from connector.transport.nixl.glue import metadata_agent_name

log = logging.getLogger(__name__)

CLAIM_WAIT_S = 2.0
"""How long a claim of an identity (or agent) still held waits for the holder's connection to end."""


class PeerInfo:
    """One accepted decode rank on one live connection (the `session` the side-channel server keeps for it): its
    Hello, the plan between the two engines, its regions, its NIXL agent, and what it holds here."""

    def __init__(self, table: "PeerTable", hello: Hello) -> None:
        self.table = table
        self.hello = hello
        self.key: PeerKey = peer_key(hello)
        self.accepted: AcceptedPeer | None = None
        self.agent = ""
        """Name its NIXL agent was loaded as ('' until loaded: at the first registration prefill serves it)."""
        self.loading: asyncio.Task | None = None
        """The load of its agent (PeerTable.load_agent), once one began."""
        self.layer_routes: dict[int, list[Route]] = {}
        """What this prefill rank sends that decode rank, by global layer (from the plan, once)."""
        self.max_blocks = max((r.num_blocks for r in hello.regions), default=0)
        """The most blocks any of its cache regions has: no block-id list of a registration can be longer."""
        self.parked = 0
        self.parked_bytes = 0
        """Registrations of this connection waiting for their request to start, and their estimated memory."""
        self.writes = 0
        """WRITEs to this peer in flight: its agent is released only once none is."""
        self.served = False
        """Some WRITE went to it."""
        self._idle = asyncio.Event()
        self._idle.set()
        self.closing = False
        self.released = asyncio.Event()
        self.admitted = False
        """Its handshake got past `admit`: from then on its connection is live."""

    @property
    def states(self) -> tuple[int, str] | None:
        """The per-request states this prefill rank sends that decode rank: (the fewest tokens any may be taken
        past decode's resume point, its pool), or None when it sends none (PoolSpec.overshoot_tokens)."""
        regions = self.accepted.regions if self.accepted is not None else {}
        tight = [(regions[(r.pool, layer)].overshoot_tokens, r.pool) for layer, routes in self.layer_routes.items()
                 for r in routes if (r.pool, layer) in regions and regions[(r.pool, layer)].per_request]
        return min(tight) if tight else None

    @property
    def evictable(self) -> bool:
        """Its connection may be closed for a newcomer's fair share (connector.transport.admission): nothing was
        ever written to it (a decode that received KV here is not closed for another)."""
        return not self.served and not self.writes

    def write_started(self) -> None:
        self.writes += 1
        self.served = True  # a request prefill computes goes there: a real decode
        self.table.agents.served(self.agent)
        self._idle.clear()

    def write_done(self) -> None:
        self.writes -= 1
        if not self.writes:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    async def aclose(self) -> None:
        """The connection ended (the side-channel server calls this)."""
        await self.table.release(self)


class PeerTable:
    def __init__(self, transport: KVTransport, own: Hello, model: ModelLayout, rank: Rank, config: SenderConfig,
                 on_release: Callable[[PeerInfo], None] = lambda info: None) -> None:
        self.transport, self.own, self.model, self.rank, self.config = transport, own, model, rank, config
        self.on_release = on_release
        self.plans = PlanCache(model, own)
        self.by_key: dict[PeerKey, PeerInfo] = {}
        """Identities held by live (or closing) connections."""
        self._agents: dict[str, PeerInfo] = {}
        self.agents = LoadedAgents(transport, config.max_peer_agents, config.agent_unloads_per_hour,
                                   max_per_host=config.max_agents_per_host)
        """The decode agents loaded on the transport (live and idle)."""

    def peek(self, hello: Hello) -> None:
        """Cheap checks of a first Hello, before anything is answered (raises LayoutError)."""
        check_peer_layout(hello, self.own, self.model, self.config.side_channel.max_peer_ranks)

    async def admit(self, hello: Hello) -> PeerInfo:
        """Accept an authenticated decode rank for its connection: claim its identity and agent name, plan (off the
        loop), check its regions. Raises (the server refuses the handshake with the text).

        Its NIXL agent is not loaded here but at the first registration prefill serves it (`load_agent`), one that
        names a request this rank computes and proves its transfer secret: a peer that holds only the token can
        handshake under as many agent names as it likes and costs no load, no unload and no socket (NIXL 1.5.1
        keeps sockets open after an unload while the peer lives: connector.engine.agents)."""
        self.peek(hello)
        if hello.role != "decode":
            raise PeerRefused(f"a {hello.role} rank cannot register with a prefill rank")
        named = metadata_agent_name(hello.agent_metadata)
        if not hello.agent_name:
            if not named:
                raise PeerRefused("the decode rank names no NIXL agent, neither in its Hello nor in its metadata")
            hello = msgspec.structs.replace(hello, agent_name=named)
        elif named is not None and named != hello.agent_name:
            raise PeerRefused(f"the decode rank's Hello names NIXL agent {hello.agent_name!r} and its metadata "
                              f"{named!r}: a broken peer")
        if hello.agent_name == self.own.agent_name:
            raise PeerRefused(f"NIXL agent name {hello.agent_name!r} is this prefill rank's own")
        self.agents.check_owner(hello.agent_name, engine_name(hello))
        await self._wait_for_holders(hello)
        info = PeerInfo(self, hello)
        self.by_key[info.key] = info
        self._agents[hello.agent_name] = info
        try:
            plan = await self.plans.plan_for(hello)
            info.accepted = accept_peer(hello, self.own, self.model, plan)
            routes = plan.layer_routes(self.rank, info.key[1:])
            views = info.accepted.views  # (block sizes that differ: a cut pool's routes go head by head)
            info.layer_routes = views.routes(routes) if views is not None else routes
        except BaseException:
            self._forget(info)
            info.released.set()
            raise
        info.admitted = True
        return info

    async def load_agent(self, info: PeerInfo, host: str = "") -> str:
        """`info`'s NIXL agent, loaded now if it is not yet (one load per connection; callers share it). `host`:
        its connection's source address (the bounds per address: connector.engine.agents). NIXL calls can wait
        behind a DRAM copy in progress: they run off the loop. Raises what the load raises (PeerRefused: a
        limit)."""
        if info.agent:
            return info.agent
        if info.loading is None:
            info.loading = asyncio.get_running_loop().create_task(self._load(info, host),
                                                                   name=f"agent of decode {info.key}")
        return await asyncio.shield(info.loading)

    async def serve_agent(self, info: PeerInfo, conn: Any) -> bool:
        """`load_agent` for a registration served on `conn`: True once loaded (False: the connection ended
        meanwhile). A load that fails (a limit, NIXL) closes the connection saying why, which fails its
        destinations."""
        try:
            return bool(await self.load_agent(info, str(getattr(conn, "host", ""))))
        except Exception as exc:  # noqa: BLE001 - PeerRefused, TransportError, NIXL's own
            reason = f"prefill could not load decode {info.key}'s NIXL agent: {exc}"
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await conn.send(Error(reason))
            await conn.aclose(reason)
            return False

    async def _load(self, info: PeerInfo, host: str) -> str:
        hello = info.hello
        name = await self.agents.acquire(hello.agent_name, hello.agent_metadata, owner=engine_name(hello), host=host,
                                         ranks=hello.tp_size * hello.pp_size)
        if info.closing:  # its connection ended while the agent loaded: it waits, idle, for the next one
            self.agents.release(name)
            return ""
        info.agent = name
        return name

    async def _wait_for_holders(self, hello: Hello) -> None:
        """Return once neither the identity nor the agent name is held (the caller claims both at once, with no
        await in between), waiting at most CLAIM_WAIT_S for holders to end (a holder that is this same decode rank
        still waiting for its agent's load: as long as that load may take); else refuse."""
        key = peer_key(hello)
        deadline, extended = asyncio.get_running_loop().time() + CLAIM_WAIT_S, False
        while True:
            named = self._agents.get(hello.agent_name)
            if named is not None and not self._holds_name(named, hello):
                named = None  # another engine claims the name too: the first whose transfer loads it keeps it
            held = [(h, what) for h, what in ((self.by_key.get(key), f"decode rank {key}"),
                                              (named, f"NIXL agent {hello.agent_name!r}")) if h is not None]
            if not held:
                return
            holder, what = held[0]
            if _retried(holder, hello) and not extended:
                # Its decode gave up on that handshake while the agent loaded, and retries: the load goes on, and
                # once it ended that connection is found closed and released; then this one reuses the agent.
                log.info("decode rank %s handshook again while its NIXL agent loads (its last handshake timed "
                         "out): waiting for that load, at most %g s", key, self.agents.load_timeout_s)
                extended = True
                deadline = asyncio.get_running_loop().time() + self.agents.load_timeout_s + CLAIM_WAIT_S
            try:
                async with asyncio.timeout_at(deadline):
                    await holder.released.wait()
            except TimeoutError:
                log.warning("refusing a second claim of %s: another live connection holds it", what)
                raise PeerRefused(f"{what} is already connected on another live connection: an identity belongs to "
                                  f"one connection (a restarted rank may reconnect once its old connection has "
                                  f"closed, within dead_after_s)") from None

    def _holds_name(self, holder: PeerInfo, hello: Hello) -> bool:
        """Whether `holder`'s claim of its agent name keeps `hello`'s out: it is the same engine (a rank
        reconnecting waits for its old connection), or the name is bound to the holder's engine (it was loaded for
        it). A claim alone binds nothing: a token holder that names a decode's agent first cannot keep it out."""
        return engine_name(holder.hello) == engine_name(hello) or \
            self.agents.owner_of(hello.agent_name) == engine_name(holder.hello)

    async def release(self, info: PeerInfo) -> None:
        """Drop a peer whose connection ended: once no WRITE to it is in flight, its agent goes idle, its entry goes."""
        if info.closing:
            await info.released.wait()
            return
        info.closing = True
        if info.loading is not None and not info.loading.done():
            info.loading.cancel()  # the load goes on (connector.engine.agents); the agent waits idle, for a reconnect
        try:
            if not await info.wait_idle(self.config.write_timeout_s + 5.0):
                log.error("decode %s: %d WRITE(s) still in flight %.0f s after its connection ended; removing its "
                          "agent anyway", info.key, info.writes, self.config.write_timeout_s + 5.0)
                if info.agent:  # a WRITE NIXL still runs: this agent must not be handed to anyone again
                    await asyncio.to_thread(self.transport.remove_peer, info.agent)
                    self.agents.forget(info.agent)
            if info.agent:
                self.agents.release(info.agent)
        finally:
            self._forget(info)
            info.released.set()
            self.on_release(info)

    def _forget(self, info: PeerInfo) -> None:
        if self.by_key.get(info.key) is info:
            del self.by_key[info.key]
        if self._agents.get(info.hello.agent_name) is info:
            del self._agents[info.hello.agent_name]

    async def aclose(self) -> None:
        for info in list(self.by_key.values()):
            await self.release(info)
        await self.agents.aclose()


def _retried(holder: PeerInfo, hello: Hello) -> bool:
    """`hello` is the same decode rank as `holder`, whose handshake still waits in `admit`: same identity (with
    the engine's key, when it has one), same NIXL agent, same metadata (which only that decode and this prefill
    ever saw). Its decode gave up on that handshake and retries."""
    return (not holder.admitted and not holder.closing and peer_key(hello) == holder.key
            and hello.agent_name == holder.hello.agent_name and hello.agent_metadata == holder.hello.agent_metadata)

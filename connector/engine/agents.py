"""The decode ranks' NIXL agents loaded on a prefill rank's transport, kept loaded across reconnects.

Who gets one. An agent loads at the first registration prefill serves for its decode (connector.engine.peers), never
at a handshake, so only decodes that are sent KV cost loads; each agent name is bound to the engine (id and engine
key) it was first loaded for (`check_owner`), so no other peer takes it over. Why NIXL keeps sockets after an unload,
and the sweep that closes those of departed peers: docs/security.md (tools/nixl_unload_leak.py reproduces it).

Why keep them. NIXL 1.5.1 leaves sockets open each time a remote agent is unloaded (remove_remote_agent): one per
UCX worker of its thread pool (`nixl_threads`), forever, also after the peer is gone (tests/test_soak.py; measured
in docs/security.md). Loading and unloading a decode's agent per connection therefore cost prefill sockets per
handshake: a peer holding the token reconnecting in a loop took prefill to its fd limit. So an agent is loaded once
and stays loaded while its connection is down ("idle"); a decode rank reconnecting with the same agent name and
the same metadata gets it back with no NIXL call at all. Metadata that differs (the agent was restarted under its
name) is loaded again, which unloads the old one first.

What bounds it (issue 33: a token holder that gets prefill to serve registrations under fresh agent names and
engine keys loads an agent each time). Loaded agents, idle ones included, are bounded three ways, and a new one that
would go past a bound unloads an idle agent that brings it back within all of them (`_victim`), else it is refused
naming the bound: its engine (engine_name) holds at most the ranks it declares (tp_size x pp_size), so a burst of
new names from one engine replaces its own; its source address holds at most `max_agents_per_host` (one decode
node's ranks fit), so a burst from one address replaces its own; and at most `max_peer_agents` are loaded in all,
where the address holding the most gives way first. Among the agents that may go: one that never received a
transfer here first, then the least recently used. Only live connections' agents are never unloaded, so an engine
that has gone loses its agents before a live one is refused. Unloads are what NIXL leaks on (while the decode
process lives), so each source address may have at most `agent_unloads_per_hour` made for its newcomers in any
hour; beyond them that address's newcomer is refused, never another address's. An agent is used only for transfers
registered on its own live connection (connector.engine.peers); an idle one is never written.
Asyncio, on the sender's loop; the NIXL calls run off it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from connector.core.errors import PeerRefused, TransportError
from connector.transport.base import KVTransport

log = logging.getLogger(__name__)
UNLOAD_WINDOW_S = 3600.0
RELEASE_WAIT_S = 2.0
LOAD_TIMEOUT_S = 120.0
"""The longest one load (NIXL's add_remote_agent, with the unload before it) is waited for. Not the handshake's
timeout: a load runs on, off the loop, when the handshake that started it gives up, and decode's retry finds the
agent loaded (connector.engine.sources retries a handshake that timed out). A load took 25-60 ms between two idle
processes and 8.7-10 s inside engines on 2 busy cores (issue 32)."""
OWNERS_PER_AGENT = 8
"""Agent names whose engine is remembered, per agent that may be loaded (max_peer_agents): far more than are loaded,
so a name unloaded for room stays bound to its engine while that engine may come back."""
SLOW_LOAD_S = 1.0
"""A load slower than this is logged with where its time went: before its thread ran, and inside NIXL."""


@dataclass(eq=False)
class _Agent:
    metadata: bytes
    host: str = ""
    """The source address of the connection it was last acquired for."""
    owner: str = ""
    """The engine it was loaded for (engine_name)."""
    busy: bool = True
    """On a live connection (or being loaded for one)."""
    served: bool = False
    """Some transfer was written to it (it belongs to a decode the router sends requests to)."""
    loading: asyncio.Task | None = field(default=None, repr=False)
    """The load in progress (unload of a victim, then NIXL's load), until it ended."""


def _idle(agent: _Agent) -> bool:
    """Loaded, on no live connection: may be unloaded for another (one still loading may not)."""
    return not agent.busy and agent.loading is None


class LoadedAgents:
    """Which decode agents the transport has loaded, which are on a live connection, and which may be unloaded."""

    def __init__(self, transport: KVTransport, max_agents: int, unloads_per_hour: int,
                 load_timeout_s: float = LOAD_TIMEOUT_S, max_per_host: int = 64) -> None:
        self.transport, self.max_agents, self.unloads_per_hour = transport, max_agents, unloads_per_hour
        self.load_timeout_s, self.max_per_host = load_timeout_s, max_per_host
        self._agents: OrderedDict[str, _Agent] = OrderedDict()
        """Loaded agents by name, least recently used first."""
        self._unloads: dict[str, deque[float]] = {}
        """When the unloads of the last hour happened, by the source address of the newcomer they made room for."""
        self._owners: OrderedDict[str, str] = OrderedDict()
        """Which engine (connector.protocol.auth.engine_name: its id and key) first had each agent name loaded,
        least recently loaded first (up to OWNERS_PER_AGENT x max_agents names, loaded ones or not)."""
        self.loads = self.reuses = self.unloads = self.refused = 0
        self._released = asyncio.Event()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        """One thread of its own for NIXL's peer loads: not the loop's default executor, where a load would queue
        behind plans and checksum digests (connector.engine.plans, receiver), and loads serialise inside NIXL
        anyway (its exclusive agent lock)."""

    @property
    def loaded(self) -> int:
        return len(self._agents)

    @property
    def in_use(self) -> int:
        return sum(a.busy for a in self._agents.values())

    @property
    def loading(self) -> int:
        return sum(a.loading is not None for a in self._agents.values())

    def served(self, name: str) -> None:
        """A transfer was written to agent `name`."""
        if (agent := self._agents.get(name)) is not None:
            agent.served = True

    def check_owner(self, name: str, owner: str) -> None:
        """Raise PeerRefused if agent `name` is bound to another engine than `owner` (the one whose decode first had
        it loaded here): a name is its first engine's, so no peer can take over, or keep out, another's agent."""
        bound = self._owners.get(name)
        if bound is not None and bound != owner:
            self.refused += 1
            raise PeerRefused(f"NIXL agent {name!r} belongs to another decode engine (the one that first received a "
                              f"transfer through it here, with another engine key): agent names are bound to the "
                              f"engine key that first used them")

    def owner_of(self, name: str) -> str | None:
        return self._owners.get(name)

    def _bind(self, name: str, owner: str) -> None:
        self._owners[name] = owner
        self._owners.move_to_end(name)
        while len(self._owners) > OWNERS_PER_AGENT * self.max_agents:
            self._owners.popitem(last=False)

    async def acquire(self, name: str, metadata: bytes, owner: str = "", host: str = "", ranks: int = 0) -> str:
        """The agent `name` (with `metadata`) for a live connection: the loaded one if its metadata is the same,
        else loaded now (unloading another first when a bound is reached: `_victim`). Raises PeerRefused (a limit)
        or whatever the transport raises. The caller holds the name for one live connection
        (connector.engine.peers). `owner`: the engine it is loaded for (engine_name); the name is bound to it from
        then on (`check_owner`). `host`: the connection's source address; `ranks`: the ranks `owner` declares
        (tp_size x pp_size; 0: unbounded), the most agents it may have loaded here.

        The load runs in a task of its own, off the loop: a caller that gives up (its handshake timed out,
        cancelling this) leaves it running, and the agent then stays loaded, idle, for the same decode's next
        handshake, which waits for a load still in progress rather than starting another."""
        self.check_owner(name, owner)
        agent = self._agents.get(name)
        if agent is not None and agent.busy:
            raise PeerRefused(f"NIXL agent {name!r} is on another live connection")
        if agent is not None and agent.metadata == metadata:
            agent.busy, agent.host = True, host
            self._agents.move_to_end(name)
            if agent.loading is not None:
                await self._wait_loaded(name, agent)
            self.reuses += 1
            self._bind(name, owner)
            return name
        if agent is not None and agent.loading is not None:
            raise PeerRefused(f"NIXL agent {name!r} is still being loaded with other metadata; retry once it is")
        victim = name if agent is not None else await self._victim(name, owner, host, ranks)
        if victim is not None:
            self._spend_unload(name, host)
        entry = _Agent(metadata, host, owner)
        if victim is not None:
            del self._agents[victim]
        self._agents[name] = entry  # holds the slot while NIXL loads
        entry.loading = asyncio.get_running_loop().create_task(self._load(name, entry, victim),
                                                                name=f"load NIXL agent {name}")
        entry.loading.add_done_callback(lambda t: _log_failed_load(t, name))
        await self._wait_loaded(name, entry)
        self.loads += 1
        self._bind(name, owner)
        return name

    async def _wait_loaded(self, name: str, entry: _Agent) -> None:
        """Wait (at most load_timeout_s) for `entry`'s load. Cancelled or timed out, the load goes on; once it
        ends the agent is idle (nobody's connection), or gone if it failed."""
        task = entry.loading
        assert task is not None
        try:
            async with asyncio.timeout(self.load_timeout_s):
                await asyncio.shield(task)
        except TimeoutError:
            entry.busy = False
            raise TransportError(f"loading NIXL agent {name!r} did not end within {self.load_timeout_s:g} s; it "
                                 f"goes on, and the decode's next handshake uses it once it has (is this process "
                                 f"starved of CPU?)") from None
        except asyncio.CancelledError:
            entry.busy = False  # the handshake gave up: the agent, once loaded, waits idle for its retry
            raise

    async def _load(self, name: str, entry: _Agent, victim: str | None) -> None:
        """Unload `victim` (if any), then load `entry`; the entry goes if this fails. Runs on as its own task."""
        loop = asyncio.get_running_loop()
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl-peer-load")
        try:
            if victim is not None:
                log.info("unloading idle NIXL agent %r for %r (%d loaded, %d from %s: settings limits.max_peer_agents, "
                         "limits.max_agents_per_host, and its engine's ranks)", victim, name, len(self._agents),
                         self._held_by(entry.host), entry.host or "this host")
                await loop.run_in_executor(self._executor, self.transport.remove_peer, victim)
                self.unloads += 1
            queued = time.monotonic()
            began = await loop.run_in_executor(self._executor, self._add, entry.metadata, name)
            ended = time.monotonic()
        except BaseException:
            if self._agents.get(name) is entry:
                del self._agents[name]
                self._released.set()
            raise
        finally:
            entry.loading = None
        if ended - queued > SLOW_LOAD_S:
            log.warning("loading NIXL agent %r took %.1f s: %.1f s before its thread ran (this process's other "
                        "threads held the CPU or the GIL), %.1f s in NIXL", name, ended - queued, began - queued,
                        ended - began)

    def _add(self, metadata: bytes, name: str) -> float:
        """(load thread) When the thread began, then the load itself."""
        began = time.monotonic()
        self.transport.add_peer(metadata, name)
        return began

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Wait (at most `timeout_s`) for loads in progress, so none runs into the transport's close."""
        pending = [a.loading for a in self._agents.values() if a.loading is not None]
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout_s)
            if late:
                log.warning("%d NIXL agent load(s) still running %.0f s after close began", len(late), timeout_s)
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def release(self, name: str) -> None:
        """The connection of agent `name` ended (no WRITE to it in flight): it stays loaded, idle."""
        if (agent := self._agents.get(name)) is not None:
            agent.busy = False
            self._agents.move_to_end(name)
            self._released.set()

    def forget(self, name: str) -> None:
        """Agent `name` was unloaded by its owner (a WRITE to it never ended): no longer loaded."""
        self._agents.pop(name, None)
        self._released.set()

    def _held_by(self, host: str) -> int:
        return sum(a.host == host for a in self._agents.values())

    def _bounds(self, owner: str, host: str, ranks: int) -> list[tuple[Callable[[_Agent], bool], str]]:
        """The bounds a new agent of engine `owner` from `host` would go past, each as (which loaded agents may
        make room for it, what the bound is): its engine's ranks, its address's share, the table."""
        bounds: list[tuple[Callable[[_Agent], bool], str]] = []
        if ranks and (n := sum(a.owner == owner for a in self._agents.values())) >= ranks:
            bounds.append((lambda a: a.owner == owner, f"decode engine {owner!r} declares {ranks} rank(s) "
                                                       f"(tp_size x pp_size) and has {n} NIXL agents loaded here"))
        if (n := self._held_by(host)) >= self.max_per_host:
            bounds.append((lambda a: a.host == host, f"{host or 'this host'} has {n} NIXL agents loaded here "
                                                     f"(setting limits.max_agents_per_host={self.max_per_host})"))
        if len(self._agents) >= self.max_agents:
            bounds.append((lambda a: True, f"{len(self._agents)} NIXL agents of decode ranks are loaded here "
                                           f"(setting limits.max_peer_agents={self.max_agents})"))
        return bounds

    def _candidates(self, bounds: list[tuple[Callable[[_Agent], bool], str]]) -> list[tuple[str, _Agent]]:
        return [(n, a) for n, a in self._agents.items() if _idle(a) and all(may(a) for may, _ in bounds)]

    async def _victim(self, name: str, owner: str, host: str, ranks: int) -> str | None:
        """None if a new agent of engine `owner` from `host` goes past no bound (`_bounds`); else the idle agent
        to unload for it, one that keeps it within every bound: of the address holding the most agents first (a
        burst from one address gives way before anyone else), then one never written to, then the least recently
        used. Raises PeerRefused naming the bounds when no such agent stays idle for RELEASE_WAIT_S (a connection
        just closed for a newcomer's fair share, or a rank's old connection, releases its agent a moment later)."""
        deadline = time.monotonic() + RELEASE_WAIT_S
        while (bounds := self._bounds(owner, host, ranks)) and not self._candidates(bounds) \
                and time.monotonic() < deadline:
            self._released.clear()
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    await self._released.wait()
            except TimeoutError:
                break
        bounds = self._bounds(owner, host, ranks)
        if not bounds:
            return None
        candidates = self._candidates(bounds)
        if not candidates:
            self.refused += 1
            raise PeerRefused(f"loading NIXL agent {name!r} needs room: {'; '.join(why for _, why in bounds)}; and "
                              f"none of the agents that could make room is idle (each is on a live connection): "
                              f"raise the setting if this many decode ranks really feed from one prefill rank")
        held = Counter(a.host for a in self._agents.values())
        order = {n: i for i, n in enumerate(self._agents)}
        return min(candidates, key=lambda c: (-held[c[1].host], c[1].served, order[c[0]]))[0]

    def _spend_unload(self, newcomer: str, host: str) -> None:
        """Count an unload against `host`'s budget (the newcomer's address): one address spending its own never
        refuses a decode from another."""
        now = time.monotonic()
        for where in list(self._unloads):
            spent = self._unloads[where]
            while spent and spent[0] < now - UNLOAD_WINDOW_S:
                spent.popleft()
            if not spent:
                del self._unloads[where]
        spent = self._unloads.setdefault(host, deque())
        if len(spent) >= self.unloads_per_hour:
            self.refused += 1
            raise PeerRefused(
                f"loading NIXL agent {newcomer!r} needs another agent unloaded first ({len(self._agents)} are loaded, "
                f"{self._held_by(host)} from {host or 'this host'}: settings limits.max_peer_agents={self.max_agents}, "
                f"limits.max_agents_per_host={self.max_per_host}), and {len(spent)} were unloaded for new agents from "
                f"{host or 'this host'} within the last hour (setting limits.agent_unloads_per_hour="
                f"{self.unloads_per_hour}, per source address: NIXL 1.5.1 leaks sockets on each unload); the next "
                f"unload is possible in {spent[0] + UNLOAD_WINDOW_S - now:.0f} s")
        spent.append(now)


def _log_failed_load(task: asyncio.Task, name: str) -> None:
    """A load's failure reaches its handshake; logged here too, as its handshake may have given up already."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("loading NIXL agent %r failed: %s", name, task.exception())

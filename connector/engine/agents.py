"""The decode ranks' NIXL agents loaded on a prefill rank's transport, kept loaded across reconnects.

Why keep them. NIXL 1.5.1 leaves sockets open each time a remote agent is unloaded (remove_remote_agent): one per
UCX worker of its thread pool (`nixl_threads`), forever, also after the peer is gone (tests/test_soak.py; measured
in docs/security.md). Loading and unloading a decode's agent per connection therefore cost prefill sockets per
handshake: a peer holding the token reconnecting in a loop took prefill to its fd limit. So an agent is loaded once
and stays loaded while its connection is down ("idle"); a decode rank reconnecting with the same agent name and
the same metadata gets it back with no NIXL call at all. Metadata that differs (the agent was restarted under its
name) is loaded again, which unloads the old one first.

What bounds it. At most `max_peer_agents` agents are loaded at once, idle ones included. A new agent when all are
loaded unloads an idle one: one that never received a transfer here first (an attacker's agents never do), the
least recently used of those, else the least recently used. Unloads are what NIXL leaks on, so at most
`agent_unloads_per_hour` happen in any hour; beyond them, and when every loaded agent is on a live connection, the
handshake is refused naming the setting (the side channel counts and logs it at its bounded rate). An agent is used
only for transfers registered on its own live connection (connector.engine.peers); an idle one is never written.
Asyncio, on the sender's loop; the NIXL calls run off it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from connector.core.errors import PeerRefused
from connector.transport.base import KVTransport

log = logging.getLogger(__name__)
UNLOAD_WINDOW_S = 3600.0
RELEASE_WAIT_S = 2.0


@dataclass(eq=False)
class _Agent:
    metadata: bytes
    busy: bool = True
    """On a live connection (or being loaded for one)."""
    served: bool = False
    """Some transfer was written to it (it belongs to a decode the router sends requests to)."""


class LoadedAgents:
    """Which decode agents the transport has loaded, which are on a live connection, and which may be unloaded."""

    def __init__(self, transport: KVTransport, max_agents: int, unloads_per_hour: int) -> None:
        self.transport, self.max_agents, self.unloads_per_hour = transport, max_agents, unloads_per_hour
        self._agents: OrderedDict[str, _Agent] = OrderedDict()
        """Loaded agents by name, least recently used first."""
        self._unloads: deque[float] = deque()
        """When the unloads of the last hour happened."""
        self.loads = self.reuses = self.unloads = self.refused = 0
        self._released = asyncio.Event()

    @property
    def loaded(self) -> int:
        return len(self._agents)

    @property
    def in_use(self) -> int:
        return sum(a.busy for a in self._agents.values())

    def served(self, name: str) -> None:
        """A transfer was written to agent `name`."""
        if (agent := self._agents.get(name)) is not None:
            agent.served = True

    async def acquire(self, name: str, metadata: bytes) -> str:
        """The agent `name` (with `metadata`) for a live connection: the loaded one if its metadata is the same,
        else loaded now (unloading another first if all are loaded). Raises PeerRefused (a limit) or whatever the
        transport raises. The caller holds the name for one live connection (connector.engine.peers)."""
        agent = self._agents.get(name)
        if agent is not None and agent.busy:
            raise PeerRefused(f"NIXL agent {name!r} is on another live connection")
        if agent is not None and agent.metadata == metadata:
            agent.busy = True
            self._agents.move_to_end(name)
            self.reuses += 1
            return name
        victim = name if agent is not None else await self._victim()
        if victim is not None:
            self._spend_unload(name)
        entry = _Agent(metadata)
        if victim is not None:
            del self._agents[victim]
        self._agents[name] = entry  # holds the slot while NIXL loads
        try:
            if victim is not None:
                log.info("unloading idle NIXL agent %r for %r (%d loaded: setting max_peer_agents)", victim, name,
                         len(self._agents))
                await asyncio.to_thread(self.transport.remove_peer, victim)
                self.unloads += 1
            loaded = await asyncio.to_thread(self.transport.add_peer, metadata, name)
        except BaseException:
            if self._agents.get(name) is entry:
                del self._agents[name]
            raise
        self.loads += 1
        return loaded

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

    async def _victim(self) -> str | None:
        """None if there is room; else the idle agent to unload: one never written to first, least recently used
        first. Raises PeerRefused when every loaded agent stays on a live connection for RELEASE_WAIT_S (a
        connection just closed for a newcomer's fair share releases its agent a moment later)."""
        deadline = time.monotonic() + RELEASE_WAIT_S
        while len(self._agents) >= self.max_agents and not any(not a.busy for a in self._agents.values()) \
                and time.monotonic() < deadline:
            self._released.clear()
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    await self._released.wait()
            except TimeoutError:
                break
        if len(self._agents) < self.max_agents:
            return None
        idle = [(n, a) for n, a in self._agents.items() if not a.busy]
        if not idle:
            self.refused += 1
            raise PeerRefused(f"{len(self._agents)} NIXL agents of decode ranks are loaded here, each on a live "
                              f"connection (setting max_peer_agents={self.max_agents}); raise it if this many decode "
                              f"ranks really feed from one prefill rank")
        return next((n for n, a in idle if not a.served), idle[0][0])

    def _spend_unload(self, newcomer: str) -> None:
        now = time.monotonic()
        while self._unloads and self._unloads[0] < now - UNLOAD_WINDOW_S:
            self._unloads.popleft()
        if len(self._unloads) >= self.unloads_per_hour:
            self.refused += 1
            raise PeerRefused(
                f"loading NIXL agent {newcomer!r} needs another agent unloaded first ({len(self._agents)} are loaded, "
                f"setting max_peer_agents={self.max_agents}), and {len(self._unloads)} were unloaded within the last "
                f"hour (setting agent_unloads_per_hour={self.unloads_per_hour}: NIXL 1.5.1 leaks sockets on each "
                f"unload); the next unload is possible in {self._unloads[0] + UNLOAD_WINDOW_S - now:.0f} s")
        self._unloads.append(now)

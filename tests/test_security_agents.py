"""Decode NIXL agents a prefill rank keeps loaded, under a token holder that gets prefill to serve it (issue 33, item
1). It sends prefill requests with its own transfer ids and secrets and registers them from fake decodes under fresh
agent names and fresh engine keys, all from one source address: each served registration loads an agent. Before,
such a burst filled the whole table (max_peer_agents) and spent the one unload budget of the process
(agent_unloads_per_hour), after which every new or restarted decode was refused for up to an hour. Now an address
holds at most max_agents_per_host agents, an engine at most its ranks, and the unload budget is per address: the
burst evicts its own agents, then is refused, and a decode from another address gets in at once.

The choices of LoadedAgents first (a fake transport: the logic above NIXL), then a real prefill process with real
NIXL (tests/test_security_fds.py's way)."""

from __future__ import annotations

import os
import time

import msgspec
import pytest

from connector.core.errors import ControlError, PeerRefused
from connector.engine import agents as agents_module
from connector.engine.agents import LoadedAgents
from connector.engine.config import SenderConfig, SideChannelConfig
from connector.protocol.auth import engine_public_key, new_engine_key, new_transfer_secret, transfer_proof
from connector.protocol.messages import Register, RegisterAck
from connector.transport.client import connect
from tests.adversary import ATTACKER_HOST, TOKEN, TOKENS, WITH_TOKEN, Relay, blocks, spawned_target
from tests.test_security import decode_config, transfer
from tests.test_security_fds import SOCKETS_PER_AGENT, fds, minted


class FakeTransport:
    """Records NIXL's peer loads and unloads."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.removed: list[str] = []

    def add_peer(self, metadata: bytes, expected_name: str | None = None) -> str:
        self.loaded.append(expected_name or "")
        return expected_name or ""

    def remove_peer(self, peer: str) -> None:
        self.removed.append(peer)


@pytest.fixture
def quick(monkeypatch):
    """Refusals come at once (a full bound waits RELEASE_WAIT_S for a connection closing to release its agent)."""
    monkeypatch.setattr(agents_module, "RELEASE_WAIT_S", 0.05)


async def idle(agents: LoadedAgents, name: str, host: str, owner: str = "", ranks: int = 0,
               served: bool = False) -> None:
    """Agent `name` loaded for a connection from `host` that then ended."""
    await agents.acquire(name, name.encode(), owner=owner or f"engine-{name}", host=host, ranks=ranks)
    if served:
        agents.served(name)
    agents.release(name)


async def test_an_address_at_its_cap_replaces_its_own_idle_agent_never_served_first(quick):
    t = FakeTransport()
    agents = LoadedAgents(t, max_agents=8, unloads_per_hour=10, max_per_host=3)
    await idle(agents, "a0", "A", served=True)
    await idle(agents, "a1", "A")
    await idle(agents, "a2", "A", served=True)
    await idle(agents, "b0", "B")  # older than a2, never served: not A's, so never A's victim
    await idle(agents, "a3", "A")
    assert t.removed == ["a1"]  # A's own, never served
    await idle(agents, "a4", "A")
    assert t.removed == ["a1", "a3"]
    await idle(agents, "a5", "A")
    assert t.removed == ["a1", "a3", "a4"]  # its never-served one each time
    await agents.acquire("a5", b"a5", owner="engine-a5", host="A")
    await agents.acquire("a0", b"a0", owner="engine-a0", host="A")
    await agents.acquire("a2", b"a2", owner="engine-a2", host="A")
    with pytest.raises(PeerRefused, match=r"A has 3 NIXL agents loaded here \(setting limits.max_agents_per_host=3\)"):
        await agents.acquire("a6", b"a6", owner="engine-a6", host="A")  # all of A's live: B's idle one stays
    assert agents.loaded == 4 and "b0" not in t.removed


async def test_a_full_table_makes_room_from_the_address_holding_the_most(quick):
    t = FakeTransport()
    agents = LoadedAgents(t, max_agents=4, unloads_per_hour=10, max_per_host=3)
    await idle(agents, "b0", "B")  # oldest, never served
    for name in ("a0", "a1", "a2"):
        await idle(agents, name, "A", served=True)
    await idle(agents, "c0", "C")
    assert t.removed == ["a0"]  # A holds the most: its least recently used, though served and newer than b0
    await agents.acquire("a1", b"a1", owner="engine-a1", host="A")
    await agents.acquire("a2", b"a2", owner="engine-a2", host="A")
    await idle(agents, "d0", "D")
    assert t.removed == ["a0", "b0"]  # A's two are live: an idle one of the others (gone engines) goes first
    for name in ("c0", "d0"):
        await agents.acquire(name, name.encode(), owner=f"engine-{name}", host=name[0].upper())
    with pytest.raises(PeerRefused, match=r"4 NIXL agents of decode ranks are loaded here \(setting "
                                          r"limits.max_peer_agents=4\).*none of the agents that could make room is idle"):
        await agents.acquire("e0", b"e0", owner="engine-e0", host="E")


async def test_one_address_spending_its_unload_budget_refuses_no_other(quick):
    t = FakeTransport()
    agents = LoadedAgents(t, max_agents=3, unloads_per_hour=2, max_per_host=2)
    for i in range(4):  # 2 loads, then 2 unloads of its own
        await idle(agents, f"a{i}", "A", served=True)
    with pytest.raises(PeerRefused, match=r"2 were unloaded for new agents from A within the last hour \(setting "
                                          r"limits.agent_unloads_per_hour=2, per source address"):
        await idle(agents, "a4", "A")
    await idle(agents, "b0", "B")  # room: no unload
    await idle(agents, "b1", "B")  # the table is full: B's newcomer takes A's room (A holds the most), on B's budget
    assert t.removed == ["a0", "a1", "a2"] and agents.loaded == 3
    await idle(agents, "c0", "C")  # and C's that of B (which holds the most now), on C's
    assert t.removed == ["a0", "a1", "a2", "b0"] and agents.unloads == 4


async def test_an_engine_holds_at_most_its_ranks_and_replaces_its_own_idle_agent(quick):
    t = FakeTransport()
    agents = LoadedAgents(t, max_agents=16, unloads_per_hour=10, max_per_host=16)
    await idle(agents, "other", "A")
    await idle(agents, "e0", "A", owner="E", ranks=2)
    await idle(agents, "e1", "A", owner="E", ranks=2, served=True)
    await idle(agents, "e2", "A", owner="E", ranks=2)  # a burst of new names from one engine
    assert t.removed == ["e0"]  # its own (not "other", older), never served first
    await idle(agents, "e3", "A", owner="E", ranks=2)
    assert t.removed == ["e0", "e2"] and agents.loaded == 3
    await agents.acquire("e1", b"e1", owner="E", host="A", ranks=2)
    await agents.acquire("e3", b"e3", owner="E", host="A", ranks=2)
    with pytest.raises(PeerRefused, match=r"decode engine 'E' declares 2 rank\(s\) \(tp_size x pp_size\) and has 2"):
        await agents.acquire("e4", b"e4", owner="E", host="A", ranks=2)
    assert "other" not in t.removed


# ---- a real prefill process --------------------------------------------------------------------------------------
MAX_AGENTS, PER_HOST, UNLOADS = 3, 2, 1
BURST = MAX_AGENTS + UNLOADS
"""Served registrations under fresh names and engine keys: enough to fill the table and spend the unload budget
(as a single budget did) with one to spare."""


@pytest.fixture(scope="module")
def target(m3):
    """A prefill rank with small agent bounds: 3 in all, 2 per address, 1 unload an hour (per address)."""
    config = SenderConfig(lease_s=60.0, write_timeout_s=30.0, max_peer_agents=MAX_AGENTS,
                          max_agents_per_host=PER_HOST, agent_unloads_per_hour=UNLOADS,
                          side_channel=SideChannelConfig(auth_token=TOKEN))
    with spawned_target(m3, config) as target:
        yield target


def test_a_burst_of_served_agents_from_one_address_cannot_keep_a_new_decode_out(target, open_rank):
    """BURST registrations of one address, each served (a request prefill computes, its secret proven) under a
    fresh agent name and engine key, each connection closed once served. Before: they filled max_peer_agents and
    spent agent_unloads_per_hour, and a decode that never connected was refused for an hour. Now the address holds
    at most max_agents_per_host agents and spends only its own unload budget (then its newcomers are refused,
    naming it); a new decode from another address gets its transfer within seconds, and prefill's agents and fds
    stay bounded."""
    mallory = open_rank(target.cluster.sc.rank_spec("decode", (0, 0), run_id="burst"))
    base = mallory.receiver(decode_config()).hello
    relay = Relay(target.port, source=ATTACKER_HOST)
    mallory.run(relay.start(), 10)
    target.wait_state("no peers left", lambda s: s["peers"] == s["connections"] == 0, timeout_s=30)
    before, fds0 = target.state(), fds(target.pid)
    secret = new_transfer_secret()

    async def register(i: int, tid: str):
        key = new_engine_key()
        hello = msgspec.structs.replace(minted(base, f"burst-{i}-{os.getpid()}"), engine_key=engine_public_key(key))
        conn = await connect("127.0.0.1", relay.port, hello, WITH_TOKEN, timeout=20, engine_key=key)
        await conn.send(Register(tid, 0, 0, blocks(mallory.spec.num_blocks, i), 0, TOKENS,
                                 proof=transfer_proof(secret, conn.nonces, tid)))
        assert isinstance(await conn.recv(10), RegisterAck)
        return conn

    async def outcome(conn) -> str:
        try:
            while True:
                answer = await conn.recv(20)
                if type(answer).__name__ in ("Complete", "Error"):
                    return getattr(answer, "reason", "served")
        except ControlError as exc:
            return str(exc)
        finally:
            await conn.aclose()

    outcomes, began = [], time.monotonic()
    for i in range(BURST):
        tid = f"t-burst-{i}"
        conn = mallory.run(register(i, tid), 30)
        target.compute(tid, index=i, secret=secret)
        outcomes.append(mallory.run(outcome(conn), 30))
        target.finished(tid)
    after = target.wait_state("burst over", lambda s: s["peers"] == s["connections"] == 0, timeout_s=30)
    print(f"\nburst of {BURST} in {time.monotonic() - began:.1f} s: {outcomes}\nagents {before['agents_loaded']} -> "
          f"{after['agents_loaded']}, unloads {before['agent_unloads']} -> {after['agent_unloads']}, fds {fds0} -> "
          f"{fds(target.pid)}")
    assert outcomes[:PER_HOST + UNLOADS] == ["served"] * (PER_HOST + UNLOADS), outcomes
    assert all(f"limits.agent_unloads_per_hour={UNLOADS}, per source address" in o
               for o in outcomes[PER_HOST + UNLOADS:]), outcomes
    assert after["agents_loaded"] - before["agents_loaded"] <= PER_HOST, after
    assert after["agent_unloads"] - before["agent_unloads"] <= UNLOADS, after
    # each agent loaded and each unloaded (while its process lives: NIXL 1.5.1) holds a socket per UCX worker
    assert fds(target.pid) <= fds0 + (PER_HOST + UNLOADS) * SOCKETS_PER_AGENT + 8

    fresh = open_rank(target.cluster.sc.rank_spec("decode", (0, 0), run_id="after-burst"))
    began = time.monotonic()
    transfer(target, fresh, fresh.receiver(decode_config()), "t-after-burst", seed=40)
    took = time.monotonic() - began
    print(f"a new decode's transfer after the burst: {took:.1f} s")
    assert took < 30.0  # within seconds (1-2 s; more on starved cores), not refused for an hour
    assert target.state()["agents_loaded"] <= MAX_AGENTS
    mallory.run(relay.aclose(), 10)

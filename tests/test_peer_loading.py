"""Loading a decode's NIXL agent on prefill (issue 32): the load runs off the loop, in a thread of its own, and goes on
when the handshake that started it gives up, so decode's retry is served by it; every wait on it is bounded. A load
is made slow by a test transport whose add_peer waits for the test to let it go (no sleeps, no timings as pass
criteria). The real-NIXL half, between OS processes: tests/test_peer_loading_real.py."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest

from connector.core.errors import PeerRefused, TransportError
from connector.engine.agents import LoadedAgents
from connector.engine.config import SenderConfig
from connector.engine.peers import PeerTable
from tests.helpers import make_model, rank_hello, side

WAIT_S = 30.0
"""Generous bound of every wait in these tests (a hang fails, a slow machine does not)."""


class GatedTransport:
    """A transport whose add_peer blocks its thread until `gate` is set; it records the loads and the threads they
    ran on, and `on_load` (if set) runs first in that thread."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.loaded: list[str] = []
        self.removed: list[str] = []
        self.threads: list[str] = []
        self.entered = threading.Event()
        self.fail: Exception | None = None
        self.on_load = None

    def add_peer(self, metadata: bytes, expected_name: str | None = None) -> str:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        if self.on_load is not None:
            self.on_load()
        assert self.gate.wait(WAIT_S), "the test never let the load go"
        if self.fail is not None:
            raise self.fail
        self.loaded.append(expected_name or "")
        return expected_name or ""

    def remove_peer(self, peer: str) -> None:
        self.removed.append(peer)


async def entered(t: GatedTransport) -> None:
    assert await asyncio.to_thread(t.entered.wait, WAIT_S)


async def test_a_load_runs_in_its_own_thread_while_the_loop_runs_on():
    """The load thread waits for a callback the loop runs: were the loop blocked by the load, this would hang."""
    t = GatedTransport()
    loop = asyncio.get_running_loop()
    ran_on_loop = threading.Event()
    t.on_load = lambda: (loop.call_soon_threadsafe(ran_on_loop.set), ran_on_loop.wait(WAIT_S))
    agents = LoadedAgents(t, max_agents=4, unloads_per_hour=10)
    assert await asyncio.wait_for(agents.acquire("d0", b"m0"), WAIT_S) == "d0"
    assert ran_on_loop.is_set()
    assert t.threads[0].startswith("nixl-peer-load"), t.threads  # not the loop's default executor
    await agents.aclose()


async def abandoned_load() -> tuple[GatedTransport, LoadedAgents, asyncio.Future]:
    """A load of "d0" held in NIXL (the gate closed) whose handshake gave up: the server's wait is cancelled."""
    t = GatedTransport()
    t.gate.clear()
    agents = LoadedAgents(t, max_agents=4, unloads_per_hour=10)
    first = asyncio.ensure_future(agents.acquire("d0", b"m0"))
    await entered(t)
    first.cancel()
    return t, agents, first


async def test_a_load_goes_on_when_its_handshake_gives_up_and_the_retry_reuses_it():
    t, agents, first = await abandoned_load()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert agents.loading == 1 and agents.in_use == 0
    retry = asyncio.ensure_future(agents.acquire("d0", b"m0"))  # joins the load in progress
    await asyncio.sleep(0)
    assert not retry.done()
    t.gate.set()
    assert await asyncio.wait_for(retry, WAIT_S) == "d0"
    assert t.loaded == ["d0"]  # one NIXL load for both handshakes
    assert (agents.loaded, agents.in_use, agents.loading, agents.reuses) == (1, 1, 0, 1)
    await agents.aclose()


async def test_an_abandoned_load_leaves_the_agent_idle_and_loaded():
    t, agents, _first = await abandoned_load()
    t.gate.set()
    await agents.aclose()  # waits for the load
    assert (agents.loaded, agents.in_use, agents.loading) == (1, 0, 0)
    assert await agents.acquire("d0", b"m0") == "d0" and t.loaded == ["d0"]


async def test_a_load_slower_than_its_bound_fails_the_wait_not_the_load():
    t = GatedTransport()
    t.gate.clear()
    agents = LoadedAgents(t, max_agents=4, unloads_per_hour=10, load_timeout_s=0.2)
    with pytest.raises(TransportError, match="did not end within 0.2 s.*next handshake uses it"):
        await agents.acquire("d0", b"m0")
    t.gate.set()
    await agents.aclose()
    assert await agents.acquire("d0", b"m0") == "d0" and t.loaded == ["d0"]


async def test_a_failed_load_reaches_its_waiter_and_leaves_nothing_loaded():
    t = GatedTransport()
    t.fail = TransportError("peer metadata is bad")
    agents = LoadedAgents(t, max_agents=4, unloads_per_hour=10)
    with pytest.raises(TransportError, match="bad"):
        await agents.acquire("d0", b"m0")
    assert agents.loaded == 0 and agents.loads == 0
    t.fail = None
    assert await agents.acquire("d0", b"m0") == "d0"
    await agents.aclose()


async def test_an_agent_still_loading_is_never_unloaded_for_another():
    t = GatedTransport()
    t.gate.clear()
    agents = LoadedAgents(t, max_agents=1, unloads_per_hour=10)
    first = asyncio.ensure_future(agents.acquire("d0", b"m0"))
    await entered(t)
    first.cancel()  # idle, but its load still runs
    with pytest.raises(PeerRefused, match="max_peer_agents=1"):
        await agents.acquire("d1", b"m1")
    with pytest.raises(PeerRefused, match="still being loaded with other metadata"):
        await agents.acquire("d0", b"other")
    assert t.removed == []
    t.gate.set()
    await agents.aclose()


# ---- the same decode rank's second handshake while its first still waits for the load (connector.engine.peers) ----
def tables(t: GatedTransport):
    model = make_model("ddkk")
    own = rank_hello(model, "prefill", side(model, "tp=1,pp=1"))
    decode = rank_hello(model, "decode", side(model, "tp=1,pp=1"))
    decode = msgspec.structs.replace(decode, agent_name="decode-agent", agent_metadata=b"decode-metadata")
    return PeerTable(t, own, model, (0, 0), SenderConfig()), decode


async def test_an_agent_loads_at_its_first_served_registration_and_a_reconnect_reuses_a_load_in_progress():
    """The handshake loads nothing (a token holder handshaking under new names costs no load); the first
    registration prefill serves loads the agent. A connection that ends while its agent loads leaves the load
    running, and the same decode's next connection gets that agent: one NIXL load for both."""
    t = GatedTransport()
    t.gate.clear()
    table, decode = tables(t)
    first = await asyncio.wait_for(table.admit(decode), WAIT_S)
    assert first.admitted and first.agent == "" and t.loaded == [] and not t.entered.is_set()
    loading = asyncio.ensure_future(table.load_agent(first))
    await entered(t)
    await first.aclose()  # decode's connection ended while NIXL loads
    with pytest.raises(asyncio.CancelledError):
        await loading
    again = await asyncio.wait_for(table.admit(decode), WAIT_S)
    second = asyncio.ensure_future(table.load_agent(again))
    await asyncio.sleep(0.05)
    assert not second.done()
    t.gate.set()
    assert await asyncio.wait_for(second, WAIT_S) == "decode-agent" == again.agent
    assert t.loaded == ["decode-agent"]
    await table.aclose()


async def test_another_decode_claiming_a_live_identity_with_other_metadata_is_refused():
    t = GatedTransport()
    table, decode = tables(t)
    first = await asyncio.wait_for(table.admit(decode), WAIT_S)
    other = msgspec.structs.replace(decode, agent_metadata=b"someone-else")
    with pytest.raises(PeerRefused, match="already connected on another live connection"):
        await asyncio.wait_for(table.admit(other), WAIT_S)
    await first.aclose()
    await table.aclose()


async def test_an_agent_name_is_bound_to_the_engine_key_that_first_loaded_it():
    """A squatter (another engine key) that names a decode's agent: while the name is bound to no engine, its claim
    keeps nobody out (the decode is admitted beside it, and the first whose transfer loads the agent binds it);
    once bound, a claim by another key is refused at the handshake, live or not."""
    t = GatedTransport()
    table, decode = tables(t)
    decode = msgspec.structs.replace(decode, engine_key=b"\x01" * 32)
    squatter = msgspec.structs.replace(decode, engine_id="mallory", engine_key=b"\x02" * 32)
    squat = await asyncio.wait_for(table.admit(squatter), WAIT_S)  # first, live
    real = await asyncio.wait_for(table.admit(decode), WAIT_S)  # not kept out
    assert await asyncio.wait_for(table.load_agent(real), WAIT_S) == "decode-agent"
    with pytest.raises(PeerRefused, match="bound to the engine key that first used them"):
        await asyncio.wait_for(table.load_agent(squat), WAIT_S)
    await squat.aclose()
    await real.aclose()
    with pytest.raises(PeerRefused, match="bound to the engine key that first used them"):
        await asyncio.wait_for(table.admit(squatter), WAIT_S)
    back = await asyncio.wait_for(table.admit(decode), WAIT_S)  # the real decode reconnecting: its agent, reused
    assert await asyncio.wait_for(table.load_agent(back), WAIT_S) == "decode-agent" and t.loaded == ["decode-agent"]
    await table.aclose()

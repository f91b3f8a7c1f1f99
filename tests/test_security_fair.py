"""Fair shares of a real prefill rank's connections (its own process, real NIXL) across source addresses, against a
peer that holds the token. Before issue 20 item 3, such a peer on four loopback addresses held every one of the
512 `max_connections` slots with authenticated connections (128 per address, `max_connections_per_host`), and fresh
decodes were refused 2 of 2. Now, with every slot taken, a newcomer from an address holding fewer than the address
holding most takes the place of one of that address's connections that never received KV (connector.transport.
admission). The slots are fewer here (24, 8 per address) so that the attack is quick to mount."""

from __future__ import annotations

import asyncio
import os

import pytest

from connector.engine.config import SenderConfig, SideChannelConfig
from sparse_kv_lab.sim.cluster import Cluster
from connector.transport.connection import ControlConnection
from connector.transport.handshake import client_handshake
from connector.transport.limits import ServerLimits
from tests.adversary import TOKEN, Target, make_scenario
from tests.test_security import RSS_SLACK, decode_config, transfer
from tests.test_security_fds import SOCKETS_PER_AGENT, fds, minted, settle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SLOTS, PER_HOST = 24, 8
ATTACKER_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
"""SLOTS / PER_HOST addresses: together they hold every slot (the decodes connect from 127.0.0.1)."""
FDS_SLACK = 8


@pytest.fixture(scope="module")
def target(m3):
    from sparse_kv_lab.sim.env import apply_env
    from sparse_kv_lab.sim.rank import SimRank

    apply_env()
    limits = ServerLimits(max_connections=SLOTS, max_connections_per_host=PER_HOST)
    config = SenderConfig(lease_s=30.0, write_timeout_s=30.0,
                          side_channel=SideChannelConfig(auth_token=TOKEN, limits=limits))
    sc = make_scenario(m3, sender_config=config)
    with Cluster(sc, spawn=("prefill",)) as cluster:
        t = Target(cluster)
        with SimRank(sc.rank_spec("decode", (0, 0), run_id="warmup")) as warm:
            transfer(t, warm, warm.receiver(decode_config()), "t-fair-warmup", seed=1)
        settle(t, "warm-up decode gone")
        t.baseline_rss = t.rss()
        yield t


async def hold(port: int, hellos: list, sources: list[str]) -> list[ControlConnection]:
    """Authenticated connections (the token), one per Hello, from `sources`; each keeps itself alive."""
    out = []
    for hello, source in zip(hellos, sources):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        reply = await asyncio.wait_for(client_handshake(reader, writer, hello, TOKEN, f"127.0.0.1:{port}", ""), 20)
        out.append(ControlConnection(reader, writer, reply, heartbeat_interval_s=1.0))
    return out


def test_a_peer_on_a_few_addresses_cannot_keep_fresh_decodes_out(target, open_rank):
    """24 authenticated connections of a peer with the token from three addresses hold every slot; two decodes
    that never connected (from a fourth) each complete a transfer byte-exact: each takes the place of one of the
    attacker's connections, which never received KV. Once the attacker leaves, connections, peers and parked
    registrations are back to the baseline, fds within its loaded agents, RSS within bounds."""
    mallory = open_rank(target.cluster.sc.rank_spec("decode", (0, 0), run_id="squatter"))
    hello = mallory.receiver(decode_config()).hello
    before, fds0 = settle(target, "baseline"), fds(target.pid)
    hellos = [minted(hello, f"squat-{i}-{os.getpid()}") for i in range(SLOTS)]
    sources = [ATTACKER_HOSTS[i % len(ATTACKER_HOSTS)] for i in range(SLOTS)]
    held = mallory.run(hold(target.port, hellos, sources), 120)
    full = target.wait_state("every slot held", lambda s: s["connections"] == SLOTS)
    assert full["open_by_host"] == SLOTS
    decodes = []
    for n in range(2):  # the first stays connected: the second needs a slot of its own
        fresh = open_rank(target.cluster.sc.rank_spec("decode", (0, 0), run_id=f"fresh-{n}"))
        receiver = fresh.receiver(decode_config())
        transfer(target, fresh, receiver, f"t-fair-{n}", seed=40 + n)
        decodes.append((fresh, receiver))
    state = target.state()
    assert state["connections"] == SLOTS, state
    for fresh, receiver in decodes:
        fresh.run(receiver.aclose(), 20)
    assert state["refused"].get("evicted", 0) >= 2, state["refused"]
    assert sum(c.is_closed for c in held) >= 2
    survivors = [c for c in held if not c.is_closed]

    async def leave() -> None:
        for conn in survivors:
            await conn.aclose()

    mallory.run(leave(), 60)
    after = settle(target, "attacker gone")
    assert after["parked"] == 0 and after["requests"] == 0
    grown = after["agents_loaded"] - before["agents_loaded"]
    assert fds(target.pid) <= fds0 + grown * SOCKETS_PER_AGENT + FDS_SLACK, (fds0, fds(target.pid), grown)
    assert target.rss() < target.baseline_rss + RSS_SLACK
    again = open_rank(target.cluster.sc.rank_spec("decode", (0, 0), run_id="after-fair"))
    transfer(target, again, again.receiver(decode_config()), "t-fair-after", seed=45)

"""Resource bounds of a real prefill rank under a peer that speaks the wire protocol: a layout claim that would
freeze the event loop, registrations that would park memory, unauthenticated bodies and idle connections, peers
that come and go by the hundred; and TLS. After each, a legitimate request is byte-exact and the prefill process's
peer table, waiting registrations and RSS are back within bounds."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from pathlib import Path

import msgspec
import pytest

from connector.core.errors import ConfigError, ControlError, TransferFailed
from connector.engine.config import SenderConfig, SideChannelConfig
from connector.engine.receiver import RecvSpec
from connector.engine.sender_state import Parked
from connector.protocol.auth import lane_tag
from connector.protocol.handshake import plan_between
from connector.protocol.messages import HEADER, PROTOCOL_VERSION, Register, RegisterAck, RegisterError, Reject
from sparse_kv_lab.sim.cluster import Cluster
from connector.transport.client import connect
from tests.adversary import TOKEN, TOKENS, WITH_TOKEN, Target, blocks, guess, make_scenario
from tests.test_security import RSS_SLACK, TARGET_CONFIG, assert_recovered, decode_config, target, transfer  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
DATA = Path(__file__).parent / "data"


@pytest.fixture
def victim(target, open_rank):
    rank = open_rank(target.cluster.sc.rank_spec("decode", (0, 0), run_id="victim"))
    target.wait_state("no peers left from earlier tests", lambda s: s["peers"] == 0)
    return rank, rank.receiver(decode_config())


def test_a_huge_layout_claim_is_refused_before_any_plan_while_a_transfer_streams(target, victim):
    """A Hello claiming tp_size=4096 blocked prefill's loop for 40 s and failed the transfer in flight. Now sizes
    that cannot be this model's, or exceed max_peer_ranks, are refused as soon as the claim arrives (a token
    holder's Auth: decode speaks second), before any plan; the transfer streaming meanwhile is byte-exact."""
    rank, receiver = victim
    dst = blocks(rank.spec.num_blocks, 11)
    got = rank.loop.submit(receiver.receive(RecvSpec("t-freeze", f"127.0.0.1:{target.port}", dst, 0, TOKENS)))
    target.compute("t-freeze", layer_ms=20.0, wait=False, index=11)  # 60 layers x 20 ms, streaming meanwhile
    claims = {"tp_size": dict(tp_size=4096), "pp_size": dict(pp_size=100_000, tp_size=1),
              "a tp the heads refuse": dict(tp_size=3)}
    for what, fields in claims.items():
        hello = msgspec.structs.replace(receiver.hello, engine_id=f"big-{what}", **fields)
        hello = msgspec.structs.replace(hello, lane=lane_tag(TOKEN, hello))  # a token holder's own lane for its claim
        began = time.monotonic()
        reply = rank.run(guess(target.port, hello, TOKEN), 20)
        assert reply.startswith("Reject"), (what, reply)
        assert time.monotonic() - began < 2.0, what
        assert any(word in reply for word in ("max_peer_ranks", "layers", "neither divides")), reply
    target.chunk_done()
    got.result(40)
    assert rank.bufs.verify(dst, 0, TOKENS) == []
    assert_recovered(target, rank, receiver, "t-freeze-after")


def test_building_a_large_peer_plan_does_not_stall_the_loop(m3, open_rank):
    """The largest claim max_peer_ranks allows (256 decode ranks) costs a plan of ~30k routes. It is built off the
    event loop (and once per peer layout): the loop keeps ticking meanwhile. Checked by where the build runs and by
    the loop's ticks during it, not by wall-clock bounds (a loaded CI machine stretches both)."""
    sc = make_scenario(m3, decode="tp=256")
    prefill = open_rank(sc.rank_spec("prefill", (0, 0), run_id="plans"))
    sender = prefill.sender(SenderConfig(port=0, side_channel=SideChannelConfig(auth_token=TOKEN)))
    big = open_rank(sc.rank_spec("decode", (0, 0), run_id="wide"))
    hello = big.receiver(decode_config()).hello
    began = time.perf_counter()
    plan_between(hello, sender.hello, m3)  # what one such plan costs here, now
    assert time.perf_counter() - began > 0.05, "the plan is too cheap here for this test to mean anything"

    cache = sender._table.plans
    builds: list[tuple[int, float, float]] = []  # (thread, start, end) of each build
    real_build = cache._build

    def build(peer):
        start = time.perf_counter()
        try:
            return real_build(peer)
        finally:
            builds.append((threading.get_ident(), start, time.perf_counter()))

    cache._build = build
    loop_thread: list[int] = []

    async def ticker(stop: asyncio.Event, ticks: list[float]) -> None:
        loop_thread.append(threading.get_ident())
        while not stop.is_set():
            await asyncio.sleep(0.001)
            ticks.append(time.perf_counter())

    ticks: list[float] = []
    stop = asyncio.Event()
    ticking = prefill.loop.submit(ticker(stop, ticks))
    for tp in (0, 1):  # two ranks of the same engine: one plan
        conn = big.run(connect("127.0.0.1", sender.port, msgspec.structs.replace(hello, tp_rank=tp), WITH_TOKEN,
                               timeout=30), 40)
        big.run(conn.aclose(), 10)
    prefill.loop.loop.call_soon_threadsafe(stop.set)
    ticking.result(10)
    assert len(builds) == 1 and len(cache._plans) == 1, builds
    thread, start, end = builds[0]
    assert thread != loop_thread[0], "the plan was built on the event loop"
    during = [t for t in ticks if start < t < end]
    assert len(during) >= 3, f"the loop ticked {len(during)} times during a {end - start:.3f} s build"


def test_waiting_registrations_are_bounded_per_connection(target, victim, open_rank):
    """A Register for a request prefill has not started was parked up to the lease (~392 MB of RSS per 50 MB
    frame). Now it is checked in full first (block-id lists no longer than the decode cache, a staging slot inside
    the announced buffer), and what waits is bounded per connection in count (64 here) and memory (16 MiB, of
    block ids kept as arrays; all connections together: tests/test_security_fds.py)."""
    rank, receiver = victim
    mallory = open_rank(target.cluster.sc.rank_spec("decode", (0, 0), run_id="mallory"))
    honest = mallory.receiver(decode_config()).hello
    # a peer that claims a huge cache, so that long block lists pass the cache bound and hit the memory bound
    liar = msgspec.structs.replace(honest, regions=[msgspec.structs.replace(r, num_blocks=1 << 40)
                                                    for r in honest.regions])
    big_ids = [list(range(100_000))] * 2  # ~9.6 MB of Python objects each as decoded; 800 kB parked as arrays

    async def flood(hello, make: list) -> list:
        conn = await connect("127.0.0.1", target.port, hello, WITH_TOKEN, timeout=10)
        out = []
        try:
            for reg in make:
                try:
                    await conn.send(reg)
                    out.append(await conn.recv(20))
                except ControlError:
                    out.append("closed")  # the server closed the connection on it
        finally:
            await conn.aclose()
        return out

    rss0 = target.rss()
    n = mallory.spec.num_blocks
    far = blocks(n, 1)
    far[0][1] = 2**31 - 1  # the largest id a Register can carry (protocol 6: packed int32)
    garbage = [Register("t-g1", 0, 0, blocks(n, 1), 0, TOKENS, staging_offset=-5),
               Register("t-g2", 0, 0, blocks(n, 1), 0, TOKENS, staging_bytes=1 << 40),
               Register("t-g3", 0, 0, [list(range(n + 1))] * 2, 0, TOKENS),
               Register("t-g4", 0, 0, far, 0, TOKENS)]
    answers = mallory.run(flood(honest, garbage), 60)
    assert all(isinstance(a, RegisterError) for a in answers), answers
    assert "staging slot" in answers[0].reason and "staging slot" in answers[1].reason
    assert "cache has" in answers[2].reason and "outside" in answers[3].reason
    bigs = [Register(f"t-big{i:02d}", 0, 0, big_ids, 0, TOKENS) for i in range(24)]
    answers = mallory.run(flood(liar, bigs), 60)
    kinds = [type(a).__name__ for a in answers]
    fits = (16 << 20) // Parked.of(None, None, bigs[0], 0.0).cost  # 20 of them within 16 MiB
    assert kinds[:fits] == ["RegisterAck"] * fits and set(kinds[fits:]) == {"RegisterError"}, kinds
    assert "max_parked_bytes_per_connection" in answers[-1].reason
    small = [Register(f"t-s{i}", 0, 0, blocks(mallory.spec.num_blocks, i), 0, TOKENS) for i in range(70)]
    answers = mallory.run(flood(honest, small), 60)
    assert sum(isinstance(a, RegisterAck) for a in answers) == 64, [type(a).__name__ for a in answers]
    huge = mallory.run(flood(liar, [Register("t-huge", 0, 0, [list(range(900_000))] * 2, 0, TOKENS)]), 60)
    assert huge[0] == "closed" or "exceeds the 4194304-byte limit" in getattr(huge[0], "reason", ""), huge
    target.wait_state("parked registrations dropped with the connection", lambda s: s["parked"] == 0)
    assert target.rss() < rss0 + RSS_SLACK
    assert_recovered(target, rank, receiver, "t-parked-bound-after")


def test_unauthenticated_bodies_are_small_and_connections_are_capped(target, victim):
    """Before any Hello check, bodies up to 64 MiB were buffered with no cap on connections: 16 unauthenticated
    connections added 965 MB. Now a frame before authentication may have 1 MiB, and connections are capped per
    source address (128) and handshakes in progress (64)."""
    rank, receiver = victim
    rss0 = target.rss()
    header = HEADER.pack(60 * 2**20, PROTOCOL_VERSION)

    def stuff(n: int) -> list[socket.socket]:
        """`n` connections that each announce a 60 MB frame and send 32 MB of it (the server closes them at the
        header, so the sends fail early; a server that buffered unauthenticated bodies would hold 512 MB)."""
        out = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", target.port), timeout=10)
            try:
                s.sendall(header + bytes(32 << 20))
            except (TimeoutError, ConnectionError):
                pass
            out.append(s)
        return out

    bodies = stuff(16)
    time.sleep(1.0)
    assert target.rss() < rss0 + 64 * 2**20, "unauthenticated bodies are being buffered"
    for s in bodies:
        s.close()
    idle = [socket.create_connection(("127.0.0.1", target.port), timeout=10) for _ in range(200)]
    time.sleep(1.5)
    closed = 0
    for s in idle:
        s.settimeout(0.05)
        try:
            closed += s.recv(1) == b""
        except (TimeoutError, BlockingIOError):
            pass
        except ConnectionResetError:
            closed += 1
    assert closed >= 200 - 64, f"only {closed} of 200 idle connections were refused"
    assert target.state()["open_by_host"] <= 64
    for s in idle:
        s.close()
    target.wait_state("idle connections gone", lambda s: s["open_by_host"] == 0)
    assert_recovered(target, rank, receiver, "t-flood-after")


def test_peers_that_come_and_go_leave_nothing_behind(target, victim, open_rank):
    """300 engine ids that came and went grew the peer table from 2 to 302 (their NIXL agents stayed loaded too).
    Now a peer, its agent and what it parked go with its connection."""
    rank, receiver = victim
    mallory = open_rank(target.cluster.sc.rank_spec("decode", (0, 0), run_id="churn"))
    hello = mallory.receiver(decode_config()).hello
    before = target.state()
    rss0 = target.rss()

    async def churn(n: int) -> int:
        acked = 0
        for i in range(n):
            conn = await connect("127.0.0.1", target.port, msgspec.structs.replace(hello, engine_id=f"churn-{i}"),
                                 WITH_TOKEN, timeout=20)
            await conn.send(Register(f"t-churn-{i}", 0, 0, blocks(mallory.spec.num_blocks, i), 0, TOKENS))
            acked += isinstance(await conn.recv(10), RegisterAck)
            await conn.aclose()
        return acked

    assert mallory.run(churn(300), 280) == 300
    after = target.wait_state("churned peers gone", lambda s: s["peers"] == before["peers"]
                              and s["agents"] == before["agents"] and s["parked"] == 0)
    assert after["connections"] == before["connections"]
    assert target.rss() < rss0 + RSS_SLACK
    assert_recovered(target, rank, receiver, "t-churn-after")


@pytest.mark.timeout(120)
def test_ucx_on_every_interface_is_logged(monkeypatch, caplog):
    """UCX listens (and advertises) on every interface unless UCX_NET_DEVICES says otherwise: say so at start-up."""
    from connector.transport.nixl import Transport, TransportConfig

    caplog.set_level(logging.WARNING, logger="connector.transport.nixl.agent")
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)

    async def open_close(name: str) -> None:
        async with Transport(TransportConfig(name=name)):
            pass

    asyncio.run(open_close("ucx-open"))
    assert any("UCX_NET_DEVICES is not set" in r.message for r in caplog.records)
    caplog.clear()
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    asyncio.run(open_close("ucx-lo"))
    assert not any("UCX_NET_DEVICES" in r.message for r in caplog.records)


def test_tls_side_channel_is_byte_exact_and_refuses_the_wrong_ca(m3, open_rank):
    """With tls_cert_file/tls_key_file on prefill and tls_ca_file on decode the side channel runs over TLS (a
    transfer is byte-exact); a decode that trusts another CA, or speaks plain TCP, does not get through."""
    tls = dict(auth_token=TOKEN, tls_cert_file=str(DATA / "side-channel-cert.pem"),
               tls_key_file=str(DATA / "side-channel-key.pem"))
    config = SenderConfig(side_channel=SideChannelConfig(**tls))
    sc = make_scenario(m3, sender_config=config)
    with Cluster(sc, spawn=("prefill",)) as cluster:
        target = Target(cluster)
        rank = open_rank(sc.rank_spec("decode", (0, 0), run_id="tls"))
        good = rank.receiver(decode_config(tls_ca_file=str(DATA / "side-channel-cert.pem")))
        transfer(target, rank, good, "t-tls", seed=12)
        rank.run(good.aclose(), 20)
        for ca in (str(DATA / "other-ca-cert.pem"), ""):
            other = rank.receiver(decode_config(tls_ca_file=ca))
            with pytest.raises(TransferFailed):
                rank.run(other.receive(RecvSpec("t-tls-bad", f"127.0.0.1:{target.port}",
                                                blocks(rank.spec.num_blocks, 13), 0, TOKENS), timeout=10), 20)
            rank.run(other.aclose(), 20)
        target.wait_state("refused TLS peers gone", lambda s: s["peers"] == 0)


def test_limits_are_settings():
    """Every limit is a kv_connector_extra_config key with its engine default."""
    from connector.vllm.config import ConnectorSettings

    s = ConnectorSettings.from_extra_config({"limits": {"max_connections": "7", "max_peer_ranks": 16,
                                                        "messages_per_s": 50, "max_parked_per_connection": 3},
                                             "tls_ca_file": "/ca.pem"})
    side_channel = s.side_channel()
    assert side_channel.limits.max_connections == 7 and side_channel.max_peer_ranks == 16
    assert side_channel.limits.messages_per_s == 50 and side_channel.tls_ca_file == "/ca.pem"
    assert s.sender_config("127.0.0.1", 5600).max_parked_per_connection == 3
    assert ConnectorSettings().side_channel() == SideChannelConfig()
    with pytest.raises(ConfigError, match="max_handshakes"):
        ConnectorSettings.from_extra_config({"max_handshakes": 0})

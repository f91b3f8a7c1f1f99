"""Attacks on a real prefill rank (its own process, auth token set, real NIXL) by a peer that speaks the wire protocol:
identity spoofing, transfers that are not the attacker's, NIXL metadata, the token on the wire, replayed handshakes,
guessing, a fake prefill. After each, a legitimate decode rank still receives a request byte-exact, and the prefill
process's peer table, NIXL agents, waiting registrations and RSS are back within bounds.
(Resource limits and churn: tests/test_security_limits.py.)"""

from __future__ import annotations

import logging
import time

import msgspec
import pytest

from connector.core.errors import ControlError, TransferFailed
from connector.engine.config import ReceiverConfig, SenderConfig, SideChannelConfig
from connector.engine.receiver import RecvSpec
from connector.protocol.messages import Abort, Heartbeat, Register, RegisterAck, RegisterError, Reject, Stopped
from sparse_kv_lab.sim.cluster import Cluster
from connector.transport.control import ControlServer
from connector.transport.client import connect
from tests.adversary import TOKEN, TOKENS, WITH_TOKEN, Relay, Target, blocks, guess, make_scenario, send_frames
from tests.helpers import QuietHandler, bare_side_channel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
RSS_SLACK = 150 * 2**20
"""How far above its post-warm-up RSS the prefill process may be after an attack (the attacks here would add
hundreds of MB to GB: tests/test_security_limits.py)."""
TARGET_CONFIG = SenderConfig(lease_s=6.0, given_up_keep_s=1.0, write_timeout_s=30.0, max_parked_per_connection=64,
                             side_channel=SideChannelConfig(auth_token=TOKEN))
"""A short lease, and a give-up keep well inside it: the lease ticks once a second, so a give-up frees the KV 1-2 s
after the request is computed and the lease 6-7 s after (test_security_insiders' early-abort test tells them apart)."""


@pytest.fixture(scope="module")
def target(m3):
    """One real prefill process for the module (token set, 6 s lease), warmed up by one legitimate transfer."""
    from sparse_kv_lab.sim.env import apply_env

    apply_env()
    from sparse_kv_lab.sim.rank import SimRank

    sc = make_scenario(m3, sender_config=TARGET_CONFIG)
    with Cluster(sc, spawn=("prefill",)) as cluster:
        t = Target(cluster)
        with SimRank(sc.rank_spec("decode", (0, 0), run_id="warmup")) as warm:
            transfer(t, warm, warm.receiver(decode_config()), "t-warmup", seed=1)
        t.wait_state("warm-up decode gone", lambda s: s["peers"] == 0)
        t.baseline_rss = t.rss()
        yield t


def decode_config(token: str = TOKEN, **side) -> ReceiverConfig:
    return ReceiverConfig(SideChannelConfig(auth_token=token, **side), transfer_timeout_s=30.0)


@pytest.fixture
def ranks(target, open_rank):
    """(victim, its receiver, mallory): two decode ranks in this process; mallory is another engine with its own
    NIXL agent and memory, which must never receive a byte."""
    sc = target.cluster.sc
    victim = open_rank(sc.rank_spec("decode", (0, 0), run_id="victim"))
    mallory = open_rank(sc.rank_spec("decode", (0, 0), run_id="mallory"))
    mallory.receiver(decode_config())  # closed with the rank
    assert target.wait_state("no peers left from earlier tests", lambda s: s["peers"] == 0)
    return victim, victim.receiver(decode_config()), mallory


def transfer(target: Target, rank, receiver, tid: str, seed: int, compute: bool = True) -> None:
    """A legitimate request: decode registers, prefill computes, every byte checked on decode."""
    dst = blocks(rank.spec.num_blocks, seed)
    fut = rank.loop.submit(receiver.receive(RecvSpec(tid, f"127.0.0.1:{target.port}", dst, 0, TOKENS)))
    if compute:
        target.compute(tid, index=seed)
    fut.result(40)
    assert rank.bufs.verify(dst, 0, TOKENS) == []


def assert_recovered(target: Target, victim, receiver, tid: str, *, peers: int = 1) -> None:
    """After an attack: a legitimate request is byte-exact, and the prefill process holds no more than the live
    peers it should, nothing waiting, and no memory the attack left behind."""
    transfer(target, victim, receiver, tid, seed=97)
    target.wait_state("prefill back to its baseline", lambda s: s["peers"] <= peers and s["agents"] <= peers
                      and s["parked"] == 0 and s["requests"] == 0)
    assert target.rss() < target.baseline_rss + RSS_SLACK, (target.rss(), target.baseline_rss)


def untouched(rank) -> bool:
    return not any(bool(t.any()) for t in rank.bufs.tensors)


def mallory_hello(mallory, **fields):
    return msgspec.structs.replace(mallory.engine.hello, **fields)


def test_a_second_claim_of_a_live_identity_or_agent_is_refused(target, ranks):
    """Spoofing: a second Hello with a live decode's engine id and rank (or its NIXL agent name, or its agent's
    metadata) used to replace that decode's agent and regions on prefill, so the victim's next transfer was written
    into the attacker's memory while the victim got Complete over zeros."""
    victim, receiver, mallory = ranks
    transfer(target, victim, receiver, "t-spoof-1", seed=2)  # the victim's connection is live
    run = mallory.run
    spoofs = {
        "its identity, mallory's agent": mallory_hello(mallory, engine_id=receiver.hello.engine_id),
        "its agent name, mallory's metadata": mallory_hello(mallory, agent_name=receiver.hello.agent_name),
        "its agent's metadata (replayed)": mallory_hello(mallory, agent_name=receiver.hello.agent_name,
                                                         agent_metadata=receiver.hello.agent_metadata),
    }
    for what, hello in spoofs.items():
        with pytest.raises(ControlError, match="already connected|names NIXL agent|bound to the engine key") as err:
            run(connect("127.0.0.1", target.port, hello, WITH_TOKEN, timeout=15), 20)
        assert "rejected the handshake" in str(err.value), what
    transfer(target, victim, receiver, "t-spoof-2", seed=3)
    assert untouched(mallory), "bytes landed in the attacker's memory"
    assert target.state()["agents"] == 1
    assert_recovered(target, victim, receiver, "t-spoof-after")


def test_transfers_belong_to_the_engine_that_registered_them(target, ranks):
    """Transfer ids were global: any peer could register a victim's id (and get a copy of its KV), abort it, or keep
    it alive with heartbeats. Now the registering engine owns it."""
    victim, receiver, mallory = ranks
    dst = blocks(victim.spec.num_blocks, 4)
    got = victim.loop.submit(receiver.receive(RecvSpec("t-owned", f"127.0.0.1:{target.port}", dst, 0, TOKENS)))
    target.wait_state("victim registered", lambda s: s["parked"] == 1)

    async def meddle() -> list:
        conn = await connect("127.0.0.1", target.port, mallory.engine.hello, WITH_TOKEN, timeout=10)
        try:
            await conn.send(Register("t-owned", 0, 0, blocks(mallory.spec.num_blocks, 5), 0, TOKENS))
            first = await conn.recv(10)
            await conn.send(Abort("t-owned", "mine now"))
            second = await conn.recv(10)
            await conn.send(Heartbeat(["t-owned"]))
            return [first, second]
        finally:
            await conn.aclose()

    refused, stopped = mallory.run(meddle(), 30)
    assert isinstance(refused, RegisterError) and "belongs to decode engine 'decode-victim'" in refused.reason
    assert stopped == Stopped("t-owned", 0, 0)  # answered (nothing of it goes to mallory), and changed nothing
    target.compute("t-owned", index=4)
    got.result(40)
    assert victim.bufs.verify(dst, 0, TOKENS) == []
    assert untouched(mallory)
    assert target.finished("t-owned") is True
    assert_recovered(target, victim, receiver, "t-owned-after")


def test_an_unrelated_abort_before_registration_does_not_deny_the_transfer(target, ranks):
    """Prefill computed the request; before its decode registers, another engine aborts it. That abort is pinned to
    the engine that sent it: the victim's registration that follows is still served."""
    victim, receiver, mallory = ranks
    target.compute("t-early-abort", index=6)

    async def abort() -> object:
        conn = await connect("127.0.0.1", target.port, mallory.engine.hello, WITH_TOKEN, timeout=10)
        try:
            await conn.send(Abort("t-early-abort", "not mine"))
            return await conn.recv(10)
        finally:
            await conn.aclose()

    assert mallory.run(abort(), 20) == Stopped("t-early-abort", 0, 0)
    transfer(target, victim, receiver, "t-early-abort", seed=6, compute=False)
    assert target.finished("t-early-abort") is True
    assert_recovered(target, victim, receiver, "t-early-abort-after")


def test_a_foreign_heartbeat_does_not_hold_kv_past_the_lease(target, ranks):
    """A finished request nobody registered is freed after its lease (6 s here) although another peer keeps
    listing it in heartbeats: only the registering connection's heartbeats extend a lease."""
    victim, receiver, mallory = ranks
    target.compute("t-pinned", index=7)
    began = time.monotonic()

    async def beat():
        return await connect("127.0.0.1", target.port, mallory.engine.hello,
                             bare_side_channel(auth_token=TOKEN, heartbeat_interval_s=0.2), timeout=10,
                             heartbeat_ids=lambda: ["t-pinned"])

    conn = mallory.run(beat(), 20)
    try:
        assert target.finished("t-pinned") is False  # freed unread, not kept
        assert time.monotonic() - began < TARGET_CONFIG.lease_s + 5.0
    finally:
        mallory.run(conn.aclose(), 10)
    assert_recovered(target, victim, receiver, "t-pinned-after")


def test_prefill_never_hands_out_its_nixl_metadata_or_addresses(target, ranks):
    """The server's Hello used to carry prefill's NIXL agent metadata, with which a peer could READ and WRITE
    prefill's KV memory directly. Push mode never needs it: the reply carries who prefill is and nothing more."""
    victim, receiver, mallory = ranks

    async def look() -> tuple:
        async with Relay(target.port) as relay:
            conn = await connect("127.0.0.1", relay.port, mallory.engine.hello, WITH_TOKEN, timeout=10)
            peer = conn.peer
            await conn.aclose()
            return peer, bytes(relay.to_client)

    peer, wire = mallory.run(look(), 20)
    assert peer.agent_metadata == b"" and peer.regions == [] and peer.staging_addr == 0
    assert b"nixlSerDes" not in wire, "NIXL metadata crossed the wire from prefill"
    assert_recovered(target, victim, receiver, "t-meta-after")


def test_the_token_never_crosses_the_wire_and_a_recorded_handshake_does_not_replay(target, ranks):
    """The token travelled in clear text and a captured Hello replayed as is. Now each side proves the token with an
    HMAC over both fresh nonces: the recording holds no token, and replaying it fails the proof."""
    victim, receiver, mallory = ranks

    async def record() -> Relay:
        async with Relay(target.port) as relay:
            conn = await connect("127.0.0.1", relay.port, receiver.hello, WITH_TOKEN, timeout=10)
            await conn.send(Heartbeat([]))
            await conn.aclose()
            return relay

    relay = victim.run(record(), 20)
    wire = bytes(relay.to_server) + bytes(relay.to_client)
    assert TOKEN.encode() not in wire and b"nixlSerDes" in bytes(relay.to_server)  # (decode's metadata, after auth)
    target.wait_state("recorded connection gone", lambda s: s["peers"] == 0)
    replies = mallory.run(send_frames(target.port, [relay.first_client_bytes[0]], read_s=10), 20)
    assert isinstance(replies[-2], Reject) and "bad auth token" in replies[-2].reason, replies
    assert target.state()["peers"] == 0
    assert_recovered(target, victim, receiver, "t-replay-after")


def test_decode_checks_prefill_knows_the_token_before_sending_its_memory(open_rank, m3):
    """A fake prefill (wrong token, or none) used to receive decode's NIXL metadata in decode's first frame. Now
    decode sends its memory only after prefill's proof checks out."""
    sc = make_scenario(m3)
    victim = open_rank(sc.rank_spec("decode", (0, 0), run_id="victim"))
    receiver = victim.receiver(decode_config())
    metadata = receiver.hello.agent_metadata

    async def fake_prefill(token: str) -> tuple[bytes, str]:
        fake = msgspec.structs.replace(receiver.hello, role="prefill", engine_id="fake-prefill", agent_name="fake",
                                       agent_metadata=b"", regions=[])

        async with ControlServer(fake, QuietHandler(), bare_side_channel(auth_token=token)) as server, \
                Relay(server.port) as relay:
            try:
                await receiver.receive(RecvSpec("t-fake", f"127.0.0.1:{relay.port}", blocks(victim.spec.num_blocks, 8),
                                                0, TOKENS), timeout=10)
                why = "received"
            except TransferFailed as exc:
                why = str(exc)
            return bytes(relay.to_server), why

    for token, reason in (("wrong-token-of-the-same-length-as-the-real-one-x", "proof of the auth_token is wrong"),
                          ("", "did not prove it knows the auth_token")):
        sent, why = victim.run(fake_prefill(token), 30)
        assert reason in why
        assert metadata not in sent and b"nixlSerDes" not in sent, "decode sent its NIXL metadata to a fake prefill"
        assert untouched(victim)


def test_wrong_guesses_are_slowed_and_then_refused_per_address(m3, open_rank):
    """440 wrong guesses a second used to be checked without delay. Now each failure is answered late, and after
    max_auth_failures (5 here) within the window (3 s here) the address's connections are closed unread; once the
    window has passed, the right token works."""
    from connector.transport.limits import ServerLimits

    limits = ServerLimits(max_auth_failures=5, auth_failure_window_s=3.0, auth_failure_delay_s=0.2)
    config = SenderConfig(side_channel=SideChannelConfig(auth_token=TOKEN, limits=limits))
    sc = make_scenario(m3, sender_config=config)
    with Cluster(sc, spawn=("prefill",)) as cluster:
        target = Target(cluster)
        guesser = open_rank(sc.rank_spec("decode", (0, 0), run_id="guesser"))
        hello = guesser.receiver(decode_config()).hello

        async def guesses(n: int) -> list[str]:
            return [await guess(target.port, hello, f"guess-{i:04d}") for i in range(n)]

        began = time.monotonic()
        outcomes = guesser.run(guesses(20), 60)
        checked = [o for o in outcomes if "bad auth token" in o]
        assert not [o for o in outcomes if o.startswith("Welcome")]
        assert len(checked) == 5, outcomes
        assert set(outcomes[5:]) <= {"closed", "reset"}, outcomes  # closed unread
        assert time.monotonic() - began >= 5 * 0.2  # the checked ones were answered late
        time.sleep(3.5)
        transfer(target, guesser, guesser.engine, "t-after-guessing", seed=9)


def test_a_side_channel_on_a_reachable_address_without_a_token_warns(m3, open_rank, caplog):
    caplog.set_level(logging.WARNING, logger="connector.transport.control")
    prefill = open_rank(make_scenario(m3, auth_token="").rank_spec("prefill", (0, 0), run_id="open"))
    prefill.sender(SenderConfig(host="0.0.0.0", port=0))
    assert any("WITHOUT an auth_token" in r.message for r in caplog.records)
    caplog.clear()
    other = open_rank(make_scenario(m3).rank_spec("prefill", (0, 0), run_id="closed"))
    other.sender(SenderConfig(host="127.0.0.1", port=0))  # loopback: only this machine reaches it
    assert not any("WITHOUT an auth_token" in r.message for r in caplog.records)


def test_register_without_the_token_is_refused_before_anything_is_kept(target, ranks):
    """With a token set, a peer that does not prove it never gets past the handshake: no peer, no agent."""
    victim, receiver, mallory = ranks
    for token in ("", "x" * 48):
        with pytest.raises(ControlError, match="bad auth token|proof of the auth_token is wrong"):
            mallory.run(connect("127.0.0.1", target.port, mallory.engine.hello, bare_side_channel(auth_token=token),
                                timeout=10), 20)
    assert target.state()["agents"] == 0
    assert_recovered(target, victim, receiver, "t-noauth-after")


def test_registration_ack_still_comes_for_a_parked_legitimate_registration(target, ranks):
    """Control: a legitimate registration for a request prefill has not started is kept (acked) and served."""
    victim, receiver, _mallory = ranks

    async def register() -> object:
        conn = await connect("127.0.0.1", target.port, receiver.hello, WITH_TOKEN, timeout=10)
        try:
            await conn.send(Register("t-parked-ok", 0, 0, blocks(victim.spec.num_blocks, 10), 0, TOKENS))
            return await conn.recv(10)
        finally:
            await conn.aclose()

    assert victim.run(register(), 20) == RegisterAck("t-parked-ok")
    target.wait_state("parked registration dropped with its connection", lambda s: s["parked"] == 0)
    assert_recovered(target, victim, receiver, "t-parked-after")

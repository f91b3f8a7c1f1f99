"""Outsiders (no token, but they reach the side-channel port) against a real prefill rank in its own process: they
must not keep decodes out. Each attack below was found against the code before issue 20: idle sockets, Hellos that
never finish and TLS sessions that never send held every handshake slot; a reopen loop from one address kept fresh
decodes out entirely; TLS sessions never started were not counted (~300 KB each); wrong proofs from a decode's
address locked the real decode out for a minute; a deeply nested frame escaped the codec with two tracebacks.

Each test asserts what failed then (said in its docstring) and, after the attack, that a legitimate decode
completes a transfer byte-exact and that prefill's connection and handshake counts are back to their baseline. The
floods run in their own process (tests.adversary.Flood) from 127.0.0.2 where they play another host, or from
127.0.0.1, the decode's own address, where the point is that the decode shares it. Deadlines are asserted with
generous bounds (a decode admitted within ADMITTED_S), not as performance."""

from __future__ import annotations

import asyncio
import itertools
import socket
import ssl
import time
from pathlib import Path

import msgspec
import pytest

from connector.engine.config import SenderConfig, SideChannelConfig
from connector.protocol.auth import lane_tag
from connector.protocol.messages import HEADER, PROTOCOL_VERSION, Reject
from sparse_kv_lab.sim.cluster import Cluster
from tests.adversary import (ATTACKER_HOST, TOKEN, Flood, Target, guess, hello_frame, make_scenario, open_sockets,
                             send_frames)
from tests.test_security import (TARGET_CONFIG, assert_recovered, decode_config, target,  # noqa: F401
                                 transfer)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
DATA = Path(__file__).parent / "data"
ADMITTED_S = 5.0
"""A legitimate decode completes a whole transfer (connect, handshake, KV) within this while an attack runs."""
SLOTS = 64
"""max_handshakes's default: what the attacks filled."""
_warmups = itertools.count()


@pytest.fixture
def victim(target, open_rank):
    """A decode rank that has authenticated before (its engine id is the same in every test: a known identity)."""
    rank = open_rank(target.cluster.sc.rank_spec("decode", (0, 0), run_id="victim"))
    target.wait_state("no peers left from earlier tests", lambda s: s["peers"] == 0)
    receiver = rank.receiver(decode_config())
    transfer(target, rank, receiver, f"t-known-warmup-{next(_warmups)}", seed=21)
    rank.run(receiver.aclose(), 20)  # known now, and not connected: the next transfer handshakes again
    return rank, rank.receiver(decode_config())


def fresh(target, open_rank, name: str, **side):
    """A decode rank that never connected (an identity prefill does not know)."""
    rank = open_rank(target.cluster.sc.rank_spec("decode", (0, 0), run_id=name))
    return rank, rank.receiver(decode_config(**side))


def timed_transfer(target, rank, receiver, tid: str, seed: int) -> float:
    began = time.monotonic()
    transfer(target, rank, receiver, tid, seed)
    took = time.monotonic() - began
    assert took < ADMITTED_S, f"{tid}: the transfer took {took:.1f} s"
    return took


def back_to_baseline(target) -> None:
    """Nothing pending, and no connection open but the authenticated ones."""
    target.wait_state("handshake budget and connections back to baseline",
                      lambda s: s["handshakes"] == 0 and s["open_by_host"] == s["connections"], timeout_s=20)


def partial_hello(hello) -> bytes:
    frame = hello_frame(hello)
    return frame[: len(frame) // 2]  # the header announces the whole body; half of it comes, never the rest


@pytest.mark.parametrize("kind", ["idle sockets", "unfinished Hellos"])
def test_held_handshake_slots_do_not_keep_decodes_out(target, victim, open_rank, kind):
    """64 connections from the decode's own address that send nothing (or half a Hello) held all 64 handshake
    slots: fresh decodes were refused until the 10 s handshake timeout. Now unauthenticated connections from one
    address have a budget of 8 and a newer one evicts the oldest: the known decode and a fresh one both get in
    while all 64 sockets are held, and what stays pending is closed 5 s after accept."""
    rank, receiver = victim
    payload = partial_hello(receiver.hello) if kind == "unfinished Hellos" else b""
    held = open_sockets(target.port, SLOTS, source="127.0.0.1", first=payload)
    try:
        assert len(held) == SLOTS
        assert target.state()["handshakes"] <= 8, "one address holds more than its budget"
        other, other_receiver = fresh(target, open_rank, f"fresh-{kind[:4]}")
        timed_transfer(target, other, other_receiver, f"t-held-fresh-{kind[:4]}", seed=22)
        timed_transfer(target, rank, receiver, f"t-held-known-{kind[:4]}", seed=23)
        other.run(other_receiver.aclose(), 20)
    finally:
        for s in held:
            s.close()
    back_to_baseline(target)
    assert_recovered(target, rank, receiver, f"t-held-after-{kind[:4]}")


def test_a_thousand_sockets_reopened_in_a_loop_do_not_keep_decodes_out(target, victim, open_rank):
    """1,000 idle sockets from one address, reopened as fast as the server closed them: 936 were closed at once,
    the other 64 held every slot, and fresh decodes got in 0 times out of 4. Now that address holds at most 8
    pending connections at a time, evicting its own: four fresh decodes and the known one each complete a
    transfer while the loop runs."""
    rank, receiver = victim
    before = target.state()["connections_refused"]
    with Flood(target.port, 1000, ATTACKER_HOST, mode="reopen"):
        time.sleep(1.0)  # the loop is at full speed
        assert target.state()["handshakes"] <= 8
        for i in range(4):
            other, other_receiver = fresh(target, open_rank, f"fresh-loop{i}")
            timed_transfer(target, other, other_receiver, f"t-loop-fresh{i}", seed=30 + i)
            other.run(other_receiver.aclose(), 20)
        timed_transfer(target, rank, receiver, "t-loop-known", seed=35)
        state = target.state()
    assert state["connections_refused"] - before >= 900, state  # evicted, all counted in the metric
    assert state["refusal_lines"] < 100, "refused connections are logged one line each"
    back_to_baseline(target)
    assert_recovered(target, rank, receiver, "t-loop-after")


def test_wrong_proofs_from_a_decodes_address_do_not_lock_it_out(target, victim, open_rank):
    """10 wrong proofs sent from the decode's own address locked the real decode out for ~56 s (the lockout was
    per address). Now failures count per (address, claimed identity): the guesser's own claim is locked out, and an
    identity that authenticated before is never locked out, even when the guesser claims it."""
    rank, receiver = victim

    async def guesses(hello, n: int) -> list[str]:  # one after the other: each wrong answer is held back 0.5 s
        return [await guess(target.port, hello, f"wrong-{i}") for i in range(n)]

    # (decode speaks second: an opening names only its lane tag, which the guesser chooses, or copies from the
    # decode's own opening it saw on the wire)
    mallory = msgspec.structs.replace(receiver.hello, engine_id="decode-mallory-guesser", lane=b"m" * 16)
    mine = rank.run(guesses(mallory, 12), 60)
    assert sum("bad auth token" in g for g in mine) == 10, mine  # then its claim is closed unanswered
    assert set(mine[10:]) <= {"closed", "reset"}, mine
    seen = msgspec.structs.replace(receiver.hello, lane=lane_tag(TOKEN, receiver.hello))
    as_victim = rank.run(guesses(seen, 12), 60)  # claiming the real decode's identity
    assert all("bad auth token" in g for g in as_victim), as_victim  # slowed, never locked out
    timed_transfer(target, rank, receiver, "t-guessed-known", seed=40)
    other, other_receiver = fresh(target, open_rank, "fresh-guessed")  # same address, another identity
    timed_transfer(target, other, other_receiver, "t-guessed-fresh", seed=41)
    other.run(other_receiver.aclose(), 20)
    back_to_baseline(target)
    assert_recovered(target, rank, receiver, "t-guessed-after")


def nested_frame(depth: int) -> bytes:
    """A Hello-tagged msgpack map whose extra field nests `depth` arrays (msgspec skips unknown fields by walking
    them, recursively)."""
    head = msgspec.msgpack.encode({"type": "hello", "junk": 0})[:-1]
    body = head + b"\x91" * depth + b"\x90"
    return HEADER.pack(len(body), PROTOCOL_VERSION) + body


def test_deeply_nested_frames_are_refused_counted_and_logged_at_a_bounded_rate(target, victim):
    """A msgpack value nested 1,000+ deep escaped the codec as RecursionError: no answer, two ERROR tracebacks per
    frame, and an outsider made prefill write 2.8 MB/s of log (none counted). Now it is a FrameError like any bad
    frame: answered with Reject, counted in the metric, and refusals are logged a few lines per interval (10 s)
    plus one summary line with the counts."""
    rank, receiver = victim
    replies = rank.run(send_frames(target.port, [nested_frame(100_000)]), 20)
    assert isinstance(replies[0], Reject) and "nested too deeply" in replies[0].reason, replies
    before = target.state()
    began = time.monotonic()
    with Flood(target.port, 1, ATTACKER_HOST, mode="churn", payload=nested_frame(5000)):
        time.sleep(3.0)
    after = target.wait_state("the flood's connections refused", lambda s: s["handshakes"] == 0)
    refused = after["refused"].get("frame", 0) - before["refused"].get("frame", 0)
    assert refused >= 100, after  # each connection counted as refused
    assert after["connections_refused"] - before["connections_refused"] >= refused
    intervals = (time.monotonic() - began) / 10.0 + 2
    assert after["refusal_lines"] - before["refusal_lines"] <= intervals * 6, (refused, after["refusal_lines"])
    timed_transfer(target, rank, receiver, "t-nested-known", seed=45)
    back_to_baseline(target)
    assert_recovered(target, rank, receiver, "t-nested-after")


def tls_session(port: int, source: str = "127.0.0.1") -> ssl.SSLSocket | None:
    """A TLS session (verified against the test CA) that sends nothing once it is up; None if the server evicted
    it during the TLS handshake."""
    ctx = ssl.create_default_context(cafile=str(DATA / "side-channel-cert.pem"))
    raw = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    try:
        return ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    except OSError:
        raw.close()
        return None


def test_tls_sessions_not_started_are_counted_and_silent_ones_do_not_keep_decodes_out(m3, open_rank):
    """TLS was asyncio's: a connection reached the guard only once its TLS handshake was done. 1,000 sockets that
    never started TLS were counted as 1 and cost 298 MB of RSS (305 KB each), and 64 TLS sessions that never sent
    held every slot. Now TLS starts per connection after admission, so every socket is counted from accept, one
    address holds at most 8, and their memory is bounded; the known and a fresh TLS decode get in meanwhile."""
    tls = dict(auth_token=TOKEN, tls_cert_file=str(DATA / "side-channel-cert.pem"),
               tls_key_file=str(DATA / "side-channel-key.pem"))
    config = SenderConfig(lease_s=3.0, write_timeout_s=30.0, side_channel=SideChannelConfig(**tls))
    sc = make_scenario(m3, sender_config=config)
    ca = str(DATA / "side-channel-cert.pem")
    with Cluster(sc, spawn=("prefill",)) as cluster:
        target = Target(cluster)
        rank = open_rank(sc.rank_spec("decode", (0, 0), run_id="tls-known"))
        known = rank.receiver(decode_config(tls_ca_file=ca))
        transfer(target, rank, known, "t-tls-warmup", seed=50)
        rank.run(known.aclose(), 20)
        known = rank.receiver(decode_config(tls_ca_file=ca))
        target.baseline_rss = rss0 = target.rss()
        with Flood(target.port, 1000, ATTACKER_HOST, mode="hold"):
            time.sleep(1.0)
            state = target.state()
            assert 1 <= state["handshakes"] <= 8, state  # counted from accept, within the address's budget
            assert target.rss() < rss0 + 40 * 2**20, "sockets that never start TLS cost memory unbounded"
            silent = [s for s in (tls_session(target.port) for _ in range(SLOTS)) if s is not None]
            try:
                assert silent, "no TLS session came up"
                other, other_receiver = fresh(target, open_rank, "tls-fresh", tls_ca_file=ca)
                timed_transfer(target, other, other_receiver, "t-tls-fresh", seed=51)
                timed_transfer(target, rank, known, "t-tls-known", seed=52)
                other.run(other_receiver.aclose(), 20)
            finally:
                for s in silent:
                    s.close()
        back_to_baseline(target)
        assert_recovered(target, rank, known, "t-tls-after")


def test_an_unauthenticated_connection_is_closed_at_its_deadline_from_accept(target, victim):
    """The whole unauthenticated part of a handshake has one deadline from accept (5 s), not a timeout per read
    that a slow sender resets: a Hello dribbled a byte at a time is closed at 5 s, not after the 10 s handshake
    timeout."""
    rank, receiver = victim
    frame = hello_frame(receiver.hello)

    async def dribble() -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", target.port)
        began = time.monotonic()
        try:
            for i in range(len(frame) - 1):
                writer.write(frame[i:i + 1])
                await writer.drain()
                await asyncio.sleep(0.05)
                if reader.at_eof():
                    break
            await asyncio.wait_for(reader.read(), 15)
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()
        return time.monotonic() - began

    took = rank.run(dribble(), 30)
    assert 4.5 < took < 8.5, took
    back_to_baseline(target)
    assert_recovered(target, rank, receiver, "t-deadline-after")

"""Insiders: peers that hold the cluster's auth token (a compromised or misconfigured node, a fake prefill) against a
real prefill rank in its own process and real decode ranks, over real NIXL. Before issue 20's item 2 each of these
worked: a token holder that knew a transfer id (vLLM's request id, which the router and both engines see) registered
first and received the victim's KV byte-exact while the victim was refused; claimed the victim's engine id at a rank
the victim had not connected and received that rank's share, its Abort failing the victim's transfer; squatted a
decode identity so that the real decode was refused; and, as a fake prefill, completed a decode's transfer early
with garbage or learned its memory while claiming 4096 ranks.

Each test asserts what failed then (said in its docstring) and, after the attack, that a legitimate request completes
byte-exact and that prefill holds nothing the attack left behind (tests.test_security.assert_recovered)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from connector.core.errors import ControlError, TransferFailed
from connector.engine.receiver import RecvSpec
from connector.protocol.auth import engine_name, new_engine_key, new_transfer_secret, transfer_proof
from connector.protocol.messages import Abort, Complete, Register, RegisterAck, RegisterError, Stopped
from connector.transport.control import ControlServer
from connector.transport.client import connect
from tests.adversary import TOKEN, TOKENS, WITH_TOKEN, Relay, blocks, make_scenario
from tests.helpers import QuietHandler, bare_side_channel
from tests.test_security import (TARGET_CONFIG, assert_recovered, decode_config, mallory_hello,  # noqa: F401
                                 ranks, target, transfer, untouched)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
LEASE_TICK_S = 1.0
"""How often prefill's sender checks its leases (connector.engine.sender._lease_loop)."""


def receive(rank, receiver, target, tid: str, seed: int, secret: str, after_prefill: bool = False):
    """Start a legitimate decode's receive of `tid` (proving `secret`); returns (future, its blocks)."""
    dst = blocks(rank.spec.num_blocks, seed)
    fut = rank.loop.submit(receiver.receive(RecvSpec(tid, f"127.0.0.1:{target.port}", dst, 0, TOKENS,
                                                     prefill_finished=after_prefill, transfer_secret=secret)))
    return fut, dst


def refusals(target) -> int:
    return target.state()["capability_refusals"]


def test_knowing_a_transfer_id_does_not_take_the_transfer_concurrent_flow(target, ranks):
    """Concurrent flow (the proxy mints the id and the secret and gives both legs both): a token holder that knows
    the id registers it before the victim. It used to own the transfer (the first engine to register) and receive the
    victim's KV byte-exact while the victim was refused ("belongs to decode engine 'decode-mallory'"). Now its
    registration waits like any other and is refused once the request starts, for its wrong proof; the victim's is
    served."""
    victim, receiver, mallory = ranks
    tid, secret = "t-take-concurrent", new_transfer_secret()
    before = refusals(target)

    async def register_first():
        conn = await connect("127.0.0.1", target.port, mallory.engine.hello, WITH_TOKEN, timeout=10)
        wrong = transfer_proof(new_transfer_secret(), conn.nonces, tid)  # a guess of the secret
        await conn.send(Register(tid, 0, 0, blocks(mallory.spec.num_blocks, 12), 0, TOKENS, proof=wrong))
        return conn, await conn.recv(10)

    conn, first = mallory.run(register_first(), 30)
    try:
        assert first == RegisterAck(tid)  # waits for the request, like a real decode's registration
        fut, dst = receive(victim, receiver, target, tid, 13, secret)
        target.wait_state("both registrations wait", lambda s: s["parked"] == 2)
        target.compute(tid, index=13, secret=secret)
        fut.result(40)
        assert victim.bufs.verify(dst, 0, TOKENS) == []
        answer = mallory.run(conn.recv(10), 20)
        assert isinstance(answer, RegisterError) and "proof of the transfer_secret is wrong" in answer.reason, answer
    finally:
        mallory.run(conn.aclose(), 10)
    assert untouched(mallory), "the victim's KV landed in the attacker's memory"
    assert target.finished(tid) is True
    assert refusals(target) - before == 1
    assert_recovered(target, victim, receiver, "t-take-concurrent-after")


def test_knowing_a_transfer_id_does_not_take_the_transfer_sequential_flow(target, ranks):
    """Sequential flow (prefill first; its scheduler mints the secret and returns it in the response's
    kv_transfer_params, which the router passes to decode): a token holder that knows the id registers it with
    `after_prefill` before the victim. It used to be served at once. Now a registration with no proof, or a wrong
    one, is refused naming transfer_secret, and counted."""
    victim, receiver, mallory = ranks
    tid, secret = "t-take-sequential", new_transfer_secret()
    target.compute(tid, index=14, secret=secret)
    before = refusals(target)

    async def take() -> list:
        conn = await connect("127.0.0.1", target.port, mallory.engine.hello, WITH_TOKEN, timeout=10)
        try:
            out = []
            for proof in (b"", transfer_proof("not-the-secret", conn.nonces, tid)):
                await conn.send(Register(tid, 0, 0, blocks(mallory.spec.num_blocks, 15), 0, TOKENS,
                                         after_prefill=True, proof=proof))
                out.append(await conn.recv(10))
            return out
        finally:
            await conn.aclose()

    none, wrong = mallory.run(take(), 30)
    assert isinstance(none, RegisterError) and "proves none" in none.reason and "transfer_secret" in none.reason
    assert isinstance(wrong, RegisterError) and "proof of the transfer_secret is wrong" in wrong.reason
    assert refusals(target) - before == 2
    fut, dst = receive(victim, receiver, target, tid, 16, secret, after_prefill=True)
    fut.result(40)
    assert victim.bufs.verify(dst, 0, TOKENS) == []
    assert untouched(mallory)
    assert target.finished(tid) is True
    assert_recovered(target, victim, receiver, "t-take-sequential-after")


def test_a_proof_recorded_on_one_connection_does_not_register_on_another(target, ranks):
    """The proof is bound to the connection's two nonces: a token holder that copied a victim's Register (no TLS)
    cannot replay it on its own connection."""
    victim, receiver, mallory = ranks
    tid, secret = "t-replayed-proof", new_transfer_secret()
    target.compute(tid, index=17, secret=secret)

    async def replay() -> object:
        conn = await connect("127.0.0.1", target.port, mallory.engine.hello, WITH_TOKEN, timeout=10)
        try:
            other = b"\x00" * len(conn.nonces)  # the proof as made for another connection's nonces
            await conn.send(Register(tid, 0, 0, blocks(mallory.spec.num_blocks, 18), 0, TOKENS, after_prefill=True,
                                     proof=transfer_proof(secret, other, tid)))
            return await conn.recv(10)
        finally:
            await conn.aclose()

    answer = mallory.run(replay(), 30)
    assert isinstance(answer, RegisterError) and "proof of the transfer_secret is wrong" in answer.reason
    transfer_with(target, victim, receiver, tid, 19, secret)
    assert untouched(mallory)
    assert_recovered(target, victim, receiver, "t-replayed-after")


def transfer_with(target, rank, receiver, tid: str, seed: int, secret: str) -> None:
    fut, dst = receive(rank, receiver, target, tid, seed, secret, after_prefill=True)
    fut.result(40)
    assert rank.bufs.verify(dst, 0, TOKENS) == []
    assert target.finished(tid) is True


async def register_then_abort(hello, port: int, tid: str, block_ids) -> list:
    """An impostor's rank (0, 1) of the victim's engine registers `tid` and then aborts it: the two answers."""
    conn = await connect("127.0.0.1", port, hello, WITH_TOKEN, timeout=10)
    try:
        await conn.send(Register(tid, 0, 1, block_ids, 0, TOKENS))
        first = await conn.recv(10)
        await conn.send(Abort(tid, "the victim's engine gives up"))
        return [first, await conn.recv(10)]
    finally:
        await conn.aclose()


def test_a_token_holders_early_abort_does_not_shorten_the_victims_lease(target, ranks):
    """Before prefill starts the request, a token holder aborts its id (guessing at the secret). Such an early
    give-up used to be pinned to the attacker's engine and still cut the request's KV keep from the lease to
    `given_up_keep_s`: the victim registering after that was refused. Now an early give-up of a transfer with a
    secret counts only with its proof, weighed when the request starts: the victim registering after
    `given_up_keep_s` (and within the lease) is served."""
    victim, receiver, mallory = ranks
    tid, secret = "t-early-abort-secret", new_transfer_secret()

    async def abort_early() -> object:
        conn = await connect("127.0.0.1", target.port, mallory.engine.hello, WITH_TOKEN, timeout=10)
        try:
            await conn.send(Abort(tid, "not mine", transfer_proof(new_transfer_secret(), conn.nonces, tid)))
            return await conn.recv(10)
        finally:
            await conn.aclose()

    # The victim's connection is up before the clock starts (a handshake on a loaded machine took over a second).
    warm = new_transfer_secret()
    target.compute("t-early-abort-warm", index=15, secret=warm)
    transfer_with(target, victim, receiver, "t-early-abort-warm", 15, warm)
    assert mallory.run(abort_early(), 20) == Stopped(tid, 0, 0)
    target.compute(tid, index=14, secret=secret)
    keep_s, lease_s = TARGET_CONFIG.given_up_keep_s, TARGET_CONFIG.lease_s
    wait_s = keep_s + LEASE_TICK_S + 0.6  # past what the attacker's give-up would have left (checked once a second)
    assert lease_s - wait_s >= 3.0, "the test needs a lease well past given_up_keep_s"
    time.sleep(wait_s)
    transfer_with(target, victim, receiver, tid, 14, secret)
    assert untouched(mallory)
    assert_recovered(target, victim, receiver, "t-early-abort-secret-after")


def test_the_owners_engine_id_at_another_rank_neither_receives_nor_aborts(target, ranks, open_rank):
    """A token holder claims the victim's engine id at a decode rank the victim has not connected ((0, 1) of a TP2
    engine: the victim is TP1). It used to pass as the owner engine: registered the victim's transfer and received
    that rank's share of the KV, and its Abort failed the victim's transfer on prefill. Now neither proves the
    transfer's secret: the registration is refused and the Abort changes nothing (answered Stopped)."""
    victim, receiver, mallory = ranks
    sc2 = make_scenario(target.cluster.sc.model, decode="tp=2,pp=1")
    impostor = open_rank(sc2.rank_spec("decode", (0, 1), run_id="victim"))  # engine id decode-victim, rank (0, 1)
    imp = impostor.receiver(decode_config())
    assert imp.hello.engine_id == receiver.hello.engine_id
    tid, secret = "t-other-rank", new_transfer_secret()
    fut, dst = receive(victim, receiver, target, tid, 20, secret)
    target.wait_state("victim registered", lambda s: s["parked"] == 1)
    before = refusals(target)
    target.compute(tid, index=20, secret=secret, layer_ms=20.0, wait=False)  # still computing while it meddles

    refused, stopped = impostor.run(register_then_abort(imp.hello, target.port, tid,
                                                        blocks(impostor.spec.num_blocks, 21)), 30)
    target.chunk_done()
    assert isinstance(refused, RegisterError) and "proves none" in refused.reason, refused
    assert stopped == Stopped(tid, 0, 0)
    fut.result(40)
    assert victim.bufs.verify(dst, 0, TOKENS) == []
    assert untouched(impostor), "the impostor received a share of the victim's KV"
    assert target.finished(tid) is True, "the impostor's Abort failed the victim's transfer"
    assert refusals(target) - before == 2
    assert_recovered(target, victim, receiver, "t-other-rank-after")


# ---- engine identity (the ranks of one engine share a key: connector.protocol.auth, "engine keys") ----------------
def test_a_squatter_on_a_decode_identity_does_not_keep_the_real_decode_out(target, ranks):
    """A token holder connects first as the victim's decode rank ('decode-victim', 0, 0) and holds the connection.
    The real decode used to be refused for as long as it did ("already connected on another live connection"). Now
    the real decode's engine is (id, key): the squatter, keyless, is another engine, and one that copies the
    victim's public key without its private key fails the handshake; the real decode is served."""
    victim, _unkeyed, mallory = ranks
    receiver = victim.receiver(decode_config(), engine_key=new_engine_key())
    squat = mallory_hello(mallory, engine_id=receiver.hello.engine_id)
    conn = mallory.run(connect("127.0.0.1", target.port, squat, WITH_TOKEN, timeout=10), 20)
    try:
        copied = mallory_hello(mallory, engine_id=receiver.hello.engine_id, agent_name="mallory-copy",
                               engine_key=receiver.hello.engine_key)
        with pytest.raises(ControlError, match="does not prove"):
            mallory.run(connect("127.0.0.1", target.port, copied, WITH_TOKEN, timeout=10,
                                engine_key=new_engine_key()), 20)
        secret = new_transfer_secret()
        fut, dst = receive(victim, receiver, target, "t-squatted", 40, secret)
        target.compute("t-squatted", index=40, secret=secret)
        fut.result(40)
        assert victim.bufs.verify(dst, 0, TOKENS) == []
        assert target.finished("t-squatted") is True
    finally:
        mallory.run(conn.aclose(), 10)
    assert untouched(mallory)
    assert_recovered(target, victim, receiver, "t-squatted-after")


def test_a_connected_engines_other_ranks_cannot_be_claimed_without_its_key(target, ranks, open_rank):
    """The victim's engine (keyed) has rank (0, 0) connected and an open transfer (no secret: a router that mints
    none) registered. A token holder claims its engine id at rank (0, 1). It used to be the owner engine: its
    registration was served (that rank's share of the KV) and its Abort failed the transfer. Now it is another
    engine: the transfer is not its own to register or abort, whatever rank it claims."""
    victim, _unkeyed, mallory = ranks
    receiver = victim.receiver(decode_config(), engine_key=new_engine_key())
    sc2 = make_scenario(target.cluster.sc.model, decode="tp=2,pp=1")
    impostor = open_rank(sc2.rank_spec("decode", (0, 1), run_id="victim"))
    imp = impostor.receiver(decode_config())
    tid = "t-open-other-rank"
    fut, dst = receive(victim, receiver, target, tid, 41, "")
    target.wait_state("victim registered", lambda s: s["parked"] == 1)

    refused, stopped = impostor.run(register_then_abort(imp.hello, target.port, tid,
                                                        blocks(impostor.spec.num_blocks, 42)), 30)
    assert isinstance(refused, RegisterError) and f"belongs to decode engine {engine_name(receiver.hello)!r}" in \
        refused.reason, refused
    assert stopped == Stopped(tid, 0, 0)
    target.compute(tid, index=41)
    fut.result(40)
    assert victim.bufs.verify(dst, 0, TOKENS) == []
    assert untouched(impostor), "the impostor received a share of the victim's KV"
    assert target.finished(tid) is True, "the impostor's Abort failed the victim's transfer"
    assert_recovered(target, victim, receiver, "t-open-other-rank-after")


def test_a_restarted_decode_engine_with_a_new_key_is_served(target, ranks, open_rank):
    """No lock-out: once a keyed engine's connections are gone, the same engine id and rank with a new key (a
    restarted engine mints one, and opens a new NIXL agent) connects and is served at once."""
    victim, _unkeyed, _mallory = ranks
    first = victim.receiver(decode_config(), engine_key=new_engine_key())
    transfer(target, victim, first, "t-before-restart", seed=43)
    victim.run(first.aclose(), 20)
    victim = open_rank(target.cluster.sc.rank_spec("decode", (0, 0), run_id="victim"))  # the restarted process
    again = victim.receiver(decode_config(), engine_key=new_engine_key())
    assert engine_name(again.hello) != engine_name(first.hello)
    transfer(target, victim, again, "t-after-restart", seed=44)
    assert_recovered(target, victim, again, "t-restart-after")


# ---- fake prefills (a token holder's server that decode connects to for a request of its own) -------------------
def fake_prefill_hello(receiver, **fields):
    fake = {"role": "prefill", "engine_id": "fake-prefill", "agent_name": "fake", "agent_metadata": b"", "regions": [],
            "staging_addr": 0, "staging_bytes": 0, "engine_key": b""}
    return msgspec.structs.replace(receiver.hello, **{**fake, **fields})


def test_a_fake_prefill_cannot_complete_or_fail_a_transfer_registered_elsewhere(target, open_rank):
    """A decode rank receives `t-real` from the real prefill, which is still computing it, and opens a connection to
    a token holder's fake prefill for a request of the attacker's (`t-bait`). The fake answers with Complete (and
    then Abort) for `t-real`. Decode used to take them: it finished `t-real` at once over blocks nobody had written
    (garbage handed to vLLM as KV). Now only the connections `t-real` was registered on count for it."""
    sc = target.cluster.sc
    victim = open_rank(sc.rank_spec("decode", (0, 0), run_id="victim"))
    receiver = victim.receiver(decode_config())
    target.wait_state("no peers left from earlier tests", lambda s: s["peers"] == 0)
    fut, dst = receive(victim, receiver, target, "t-real", 30, "")
    target.wait_state("victim registered", lambda s: s["parked"] == 1)
    sent = []

    class Liar(QuietHandler):
        async def on_message(self, conn, msg) -> None:
            if isinstance(msg, Register) and msg.transfer_id == "t-bait":
                for lie in (Complete("t-real", 0, 0, 10**6, 1), Abort("t-real", "the fake says so")):
                    await conn.send(lie)
                    sent.append(lie)
            elif isinstance(msg, Abort) and msg.transfer_id == "t-bait":  # decode gives its bait up: the fake lets go
                await conn.send(Stopped("t-bait", 0, 0))

    # The bait's timeout stays well inside the target's 6 s lease, which also bounds how long t-real waits parked
    # there: at 3 s too, the lease sometimes refused t-real first (a race, not the attack).
    async def bait() -> str:
        async with ControlServer(fake_prefill_hello(receiver), Liar(), bare_side_channel(auth_token=TOKEN)) \
                as server:
            try:
                await receiver.receive(RecvSpec("t-bait", f"127.0.0.1:{server.port}",
                                                blocks(victim.spec.num_blocks, 31), 0, TOKENS), timeout=1)
                return "received"
            except TransferFailed as exc:
                return str(exc)

    why = victim.run(bait(), 30)
    assert "no completion" in why, why  # the fake never completed its own bait
    assert len(sent) == 2
    assert not fut.done(), f"decode finished t-real on a fake prefill's word: {fut.exception() if fut.done() else None!r}"
    target.compute("t-real", index=30)
    fut.result(40)
    assert victim.bufs.verify(dst, 0, TOKENS) == []
    assert target.finished("t-real") is True
    assert_recovered(target, victim, receiver, "t-real-after")


def test_a_fake_prefill_of_4096_ranks_learns_nothing_of_decodes_memory(target, open_rank):
    """A fake prefill with the token claims tp_size=4096. Decode used to check the claim only after the handshake,
    so its Auth (NIXL metadata, regions, staging buffer) had already gone to the fake. Now the claim is checked as
    the fake's Hello arrives, and decode sends a Reject naming it instead of its memory."""
    victim = open_rank(target.cluster.sc.rank_spec("decode", (0, 0), run_id="victim"))
    receiver = victim.receiver(decode_config())
    metadata = receiver.hello.agent_metadata

    async def fake() -> tuple[bytes, str]:
        hello = fake_prefill_hello(receiver, tp_size=4096)
        async with ControlServer(hello, QuietHandler(), bare_side_channel(auth_token=TOKEN)) as server, \
                Relay(server.port) as relay:
            try:
                await receiver.receive(RecvSpec("t-huge", f"127.0.0.1:{relay.port}",
                                                blocks(victim.spec.num_blocks, 32), 0, TOKENS), timeout=10)
                why = "received"
            except TransferFailed as exc:
                why = str(exc)
            await asyncio.sleep(0.2)  # the relay has passed on all decode wrote
            return bytes(relay.to_server), why

    sent, why = victim.run(fake(), 30)
    assert "tp_size=4096" in why and "max_peer_ranks" in why, why
    assert metadata not in sent and b"nixlSerDes" not in sent, "decode sent its NIXL metadata to the fake prefill"
    assert untouched(victim)
    transfer(target, victim, receiver, "t-huge-after", seed=33)

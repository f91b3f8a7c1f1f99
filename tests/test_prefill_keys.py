"""Prefill keys (README, Security): a decode with `trusted_prefill_keys` sends its memory only to a prefill that
proves one of them. Before them, a token holder's fake prefill that a decode connected to (for a request whose
kv_transfer_params pointed there: any client of decode's HTTP API chooses them) received decode's NIXL metadata and
regions, and its direct NIXL WRITE landed in another request's blocks. Here: the key file, the keygen command, the
settings, the handshake over real sockets, and a real prefill process with a key serving a decode that trusts it,
byte-exact, while fake prefills (no key, an untrusted key, the trusted key copied without its private half) learn
nothing of decode's memory."""

from __future__ import annotations

import asyncio
import os
import stat

import msgspec
import pytest

from connector.cli.main import main as cli
from connector.core.errors import ConfigError, TransferFailed
from connector.engine.config import ReceiverConfig, SenderConfig
from connector.engine.receiver import RecvSpec
from connector.protocol.auth import engine_public_key, key_from_text, new_engine_key
from connector.transport.control import ControlServer
from connector.transport.side_channel import SideChannelConfig
from connector.vllm.config import ConnectorSettings
from tests.adversary import TOKEN, TOKENS, Relay, Target, blocks, spawned_target
from tests.helpers import QuietHandler, bare_side_channel
from tests.test_security import untouched
from tests.test_security_insiders import fake_prefill_hello

PREFILL_KEY = new_engine_key()
TRUSTED = frozenset({engine_public_key(PREFILL_KEY)})


# ---- the key file and the settings -----------------------------------------------------------------------------
def test_keygen_writes_a_private_key_once_and_prints_its_public_half(tmp_path, capsys):
    path = tmp_path / "prefill.key"
    assert cli(["keygen", str(path)]) == 0
    public, prefill_line, decode_line = capsys.readouterr().out.splitlines()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = key_from_text(path.read_text(), "the file")
    assert public == engine_public_key(key).hex() and public in decode_line and str(path) in prefill_line
    assert cli(["keygen", str(path), "--public"]) == 0
    assert capsys.readouterr().out.strip() == public
    before = path.read_text()
    assert cli(["keygen", str(path)]) == 2  # never over an existing key
    assert "exists: keygen never overwrites a key" in capsys.readouterr().err and path.read_text() == before
    settings = ConnectorSettings.from_extra_config({"prefill_key_file": str(path), "trusted_prefill_keys": [public]})
    side = settings.side_channel()
    assert side.prefill_key == key and side.trusted_keys == {engine_public_key(key)}


@pytest.mark.parametrize("extra, message", [
    ({"prefill_key_file": "/nonexistent/prefill.key"}, "prefill_key_file '/nonexistent/prefill.key' cannot be read"),
    ({"prefill_key_file": "EMPTY"}, "is not an Ed25519 key of 64 hex digits (got 0 characters"),
    ({"trusted_prefill_keys": ["abc"]}, "trusted_prefill_keys[0] ('abc') is not an Ed25519 key"),
])
def test_a_bad_key_setting_is_named(tmp_path, extra, message):
    if extra.get("prefill_key_file") == "EMPTY":
        (tmp_path / "empty.key").write_text("\n")
        extra = {"prefill_key_file": str(tmp_path / "empty.key")}
    with pytest.raises(ConfigError) as err:
        ConnectorSettings.from_extra_config(extra).side_channel()
    assert message in str(err.value)


# ---- a real prefill process with a key, fake prefills without one -----------------------------------------------
@pytest.fixture(scope="module")
def keyed_target(m3):
    """One real prefill process signing its handshakes with PREFILL_KEY (token set as well)."""
    config = SenderConfig(lease_s=10.0, side_channel=SideChannelConfig(auth_token=TOKEN, prefill_key=PREFILL_KEY))
    with spawned_target(m3, config) as target:
        yield target


def trusting(trusted: frozenset[bytes] = TRUSTED) -> ReceiverConfig:
    return ReceiverConfig(SideChannelConfig(auth_token=TOKEN, trusted_keys=trusted), transfer_timeout_s=30.0)


def transfer(target: Target, rank, receiver, tid: str, seed: int) -> None:
    dst = blocks(rank.spec.num_blocks, seed)
    fut = rank.loop.submit(receiver.receive(RecvSpec(tid, f"127.0.0.1:{target.port}", dst, 0, TOKENS)))
    target.compute(tid, index=seed)
    fut.result(40)
    assert rank.bufs.verify(dst, 0, TOKENS) == []
    assert target.finished(tid) is True


@pytest.mark.slow
def test_a_decode_that_trusts_the_prefills_key_is_served_byte_exact(keyed_target, open_rank):
    rank = open_rank(keyed_target.cluster.sc.rank_spec("decode", (0, 0), run_id="trusting"))
    transfer(keyed_target, rank, rank.receiver(trusting()), "t-keyed", seed=3)
    # A decode that trusts no key (the default) is served by a keyed prefill all the same.
    rank2 = open_rank(keyed_target.cluster.sc.rank_spec("decode", (0, 0), run_id="default"))
    transfer(keyed_target, rank2, rank2.receiver(trusting(frozenset())), "t-keyed-default", seed=4)


@pytest.mark.slow
def test_a_decode_that_trusts_another_key_refuses_the_real_prefill_before_sending_its_memory(keyed_target,
                                                                                            open_rank):
    rank = open_rank(keyed_target.cluster.sc.rank_spec("decode", (0, 0), run_id="other-key"))
    receiver = rank.receiver(trusting(frozenset({engine_public_key(new_engine_key())})))
    fut = rank.loop.submit(receiver.receive(RecvSpec("t-untrusted", f"127.0.0.1:{keyed_target.port}",
                                                     blocks(rank.spec.num_blocks, 5), 0, TOKENS), timeout=10))
    with pytest.raises(TransferFailed, match="is not in decode's trusted_prefill_keys"):
        fut.result(30)
    assert untouched(rank)


@pytest.mark.slow
@pytest.mark.parametrize("fake", ["no key", "an untrusted key", "the trusted key, copied"])
def test_a_token_holder_posing_as_prefill_learns_nothing_of_a_decode_that_trusts_prefill_keys(keyed_target,
                                                                                              open_rank, fake):
    """The fake holds the token, so its proof is right; decode refuses it for its key, sends a Reject naming
    trusted_prefill_keys instead of its memory, and keeps working with the real prefill."""
    # (an engine key of its own, so its agent name is bound to it: a run id no other test's decode uses)
    rank = open_rank(keyed_target.cluster.sc.rank_spec("decode", (0, 0), run_id=f"victim-{fake.replace(' ', '-')}"))
    receiver = rank.receiver(trusting())
    receiver.set_engine_key(new_engine_key())
    metadata = receiver.hello.agent_metadata

    async def pose() -> tuple[bytes, str]:
        key = {"no key": b"", "an untrusted key": new_engine_key(), "the trusted key, copied": new_engine_key()}[fake]
        async with ControlServer(fake_prefill_hello(receiver), QuietHandler(),
                                 bare_side_channel(auth_token=TOKEN, prefill_key=key)) as server, \
                Relay(server.port) as relay:
            if fake == "the trusted key, copied":  # what a real prefill's Hello shows, signed with another key
                server._hs.identity = msgspec.structs.replace(server._hs.identity, engine_key=next(iter(TRUSTED)))
            try:
                await receiver.receive(RecvSpec("t-bait", f"127.0.0.1:{relay.port}", blocks(rank.spec.num_blocks, 6),
                                                0, TOKENS), timeout=10)
                why = "received"
            except TransferFailed as exc:
                why = str(exc)
            await asyncio.sleep(0.2)  # the relay has passed on all decode wrote
            return bytes(relay.to_server), why

    sent, why = rank.run(pose(), 30)
    expected = {"no key": "this prefill has none", "an untrusted key": "is not in decode's trusted_prefill_keys",
                "the trusted key, copied": "does not prove it"}[fake]
    assert expected in why and "nothing about decode's memory was sent" in why, why
    assert metadata not in sent and b"nixlSerDes" not in sent, "decode sent its NIXL metadata to the fake prefill"
    # Nor who it is (decode speaks second): its agent's name (with which the fake could claim it at the real prefill
    # first), its engine id and key, the transfer it came for.
    for what in (receiver.hello.agent_name, receiver.hello.engine_id, "t-bait"):
        assert what.encode() not in sent, what
    assert receiver.hello.engine_key and receiver.hello.engine_key not in sent
    assert untouched(rank)
    transfer(keyed_target, rank, receiver, f"t-after-{fake.replace(' ', '-')}", seed=7)


@pytest.mark.slow
def test_a_listener_named_as_prefill_addr_reads_nothing_identifying(keyed_target, open_rank):
    """Anyone who can send decode a request names a listener of theirs as prefill_addr. Decode speaks second: the
    listener reads an opening (protocol version, role, model, a nonce, a lane tag), never decode's engine id, engine
    key, NIXL agent name or metadata, nor the transfer id; the request fails at decode's timeout, and decode keeps
    working with the real prefill."""
    rank = open_rank(keyed_target.cluster.sc.rank_spec("decode", (0, 0), run_id="victim-listened"))
    receiver = rank.receiver(trusting())
    receiver.set_engine_key(new_engine_key())
    heard = bytearray()

    async def listen() -> str:
        async def keep(reader, writer) -> None:
            heard.extend(await reader.read(1 << 20))  # the whole opening, then wait: a listener proves nothing
            await asyncio.sleep(5)
            writer.close()

        server = await asyncio.start_server(keep, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            await receiver.receive(RecvSpec("t-listened-secret-id", f"127.0.0.1:{port}",
                                            blocks(rank.spec.num_blocks, 8), 0, TOKENS), timeout=3)
            return "received"
        except TransferFailed as exc:
            return str(exc)
        finally:
            server.close()

    why = rank.run(listen(), 30)
    assert why != "received"
    assert heard, "decode sent nothing at all"
    hello = receiver.hello
    for what in (hello.agent_name.encode(), hello.engine_id.encode(), b"t-listened-secret-id", hello.engine_key,
                 hello.agent_metadata[:64], b"nixlSerDes"):
        assert what and what not in bytes(heard), what
    assert untouched(rank)
    transfer(keyed_target, rank, receiver, "t-after-listener", seed=9)

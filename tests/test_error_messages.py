"""What each side says when a pair is set up wrong, as the operator reads it: a token that differs is named on both
sides; a model that differs says what differs; an HTTP server where a side channel should be is named as one; only
a connection that could not be opened is "cannot reach", a prefill that answered and refused says why."""

from __future__ import annotations

import logging

import msgspec
import pytest

from connector.core.errors import ControlError, FrameError, TransferFailed, Unreachable
from connector.core.hf_config import load_model
from connector.engine.receiver import RecvSpec
from connector.protocol.handshake import check_hello, layout_wire
from connector.protocol.messages import HEADER, PROTOCOL_VERSION, check_header
from connector.transport.control import ControlServer
from connector.transport.client import connect
from connector.transport.ports import free_ports
from tests.adversary import blocks, make_scenario
from tests.helpers import QuietHandler, bare_side_channel, log_records
from tests.test_control import hello

pytestmark = [pytest.mark.timeout(120)]
SERVER_LOG = "connector.transport.control"


def test_an_http_answer_and_an_http_request_are_named():
    with pytest.raises(FrameError, match="the peer answered in HTTP .*1213486160 bytes.*not a side channel: give "
                                         "decode prefill's side_channel_host:side_channel_port"):
        check_header(b"HTTP/1", 1 << 20)
    with pytest.raises(FrameError, match="the peer sent an HTTP request \\('GET '...,.*pointed at side_channel_port"):
        check_header(b"GET / ", 1 << 20)
    with pytest.raises(FrameError, match="^frame of 16777216 bytes exceeds the 1048576-byte limit$"):
        check_header(HEADER.pack(1 << 24, PROTOCOL_VERSION), 1 << 20)


def test_a_fingerprint_mismatch_says_what_differs():
    m3, qwen = load_model("minimax-m3"), load_model("qwen3-8b")
    peer = msgspec.structs.replace(hello("decode"), fingerprint=m3.fingerprint(), layout=layout_wire(m3),
                                   num_layers=m3.num_layers, nonce=b"n" * 32, agent_metadata=b"", regions=[])
    own = msgspec.structs.replace(hello("prefill"), fingerprint=qwen.fingerprint(), layout=layout_wire(qwen),
                                  num_layers=qwen.num_layers, block_size=128)
    with pytest.raises(ControlError) as err:
        check_hello(peer, own)
    text = str(err.value)
    assert f"fingerprint mismatch: peer has {m3.fingerprint()}, this side has {qwen.fingerprint()}" in text
    for part in ("has 60 layers, prefill", " 36 (a different model", "Serve the same model"):
        assert part in text, (part, text)
    fp8 = load_model("qwen3-8b", "fp8")
    peer = msgspec.structs.replace(peer, fingerprint=fp8.fingerprint(), layout=layout_wire(fp8),
                                   num_layers=fp8.num_layers, block_size=128)
    with pytest.raises(ControlError, match=r"keeps kv on layers 0-35 \(8 head\(s\) x 256 B per token.*, prefill .*"
                                           r"kv on layers 0-35 \(8 head\(s\) x 512 B per token"):
        check_hello(peer, own)


async def test_a_token_that_differs_is_named_on_both_sides():
    with log_records(SERVER_LOG) as logged:
        async with ControlServer(hello("prefill"), QuietHandler(),
                                 bare_side_channel(auth_token="the-prefill-token-of-32-characters")) as srv:
            with pytest.raises(ControlError, match="auth_token differs between prefill and decode: prefill's proof"):
                await connect("127.0.0.1", srv.port, hello(),
                              bare_side_channel(auth_token="the-decode-token-of-32-characters!"), timeout=5)
            with pytest.raises(ControlError, match="rejected the handshake: auth_token differs between prefill and "
                                                   "decode \\(bad auth token: this prefill requires auth_token and "
                                                   "the peer sent no proof\\)"):
                await connect("127.0.0.1", srv.port, hello(), bare_side_channel(), timeout=5)
    closing = [r.getMessage() for r in logged if r.getMessage().startswith("closing")]
    assert len(closing) == 2, closing
    # (decode speaks second: a decode that refuses prefill's Hello has not said who it is)
    assert "a decode rank refused this side's Hello: auth_token differs between prefill and decode: prefill's " \
           "proof" in closing[0]
    assert "auth_token differs between prefill and decode (bad auth token" in closing[1]


async def test_a_closed_port_is_unreachable():
    with pytest.raises(Unreachable, match="cannot connect to 127.0.0.1"):
        await connect("127.0.0.1", free_ports(), hello(), bare_side_channel(), timeout=2)


def test_decode_says_cannot_reach_only_when_nothing_answered(open_rank, m3):
    from connector.engine.config import ReceiverConfig
    from connector.transport.side_channel import SideChannelConfig

    sc = make_scenario(m3)
    decode = open_rank(sc.rank_spec("decode", (0, 0), run_id="decode"))
    receiver = decode.receiver(ReceiverConfig(SideChannelConfig(auth_token="the-decode-token-of-32-characters!"),
                                              transfer_timeout_s=10.0))
    closed = free_ports()

    async def attempt(port: int) -> str:
        try:
            await receiver.receive(RecvSpec("t1", f"127.0.0.1:{port}", blocks(decode.spec.num_blocks, 1), 0, 64),
                                   timeout=10)
        except TransferFailed as exc:
            return str(exc)
        return "received"

    assert decode.run(attempt(closed), 20).startswith(f"cannot reach prefill 127.0.0.1:{closed} for 't1': cannot "
                                                     f"connect to 127.0.0.1:{closed}")

    async def refused() -> str:
        prefill = msgspec.structs.replace(receiver.hello, role="prefill", engine_id="p", agent_name="p",
                                          agent_metadata=b"", regions=[])

        async with ControlServer(prefill, QuietHandler(),
                                 bare_side_channel(auth_token="the-prefill-token-of-32-characters")) as server:
            return await attempt(server.port)

    why = decode.run(refused(), 20)
    assert why.startswith("prefill 127.0.0.1:") and "answered, but decode cannot use it for 't1'" in why, why
    assert "auth_token differs between prefill and decode" in why and "cannot reach" not in why

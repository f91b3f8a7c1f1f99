"""Side channel: frame codec, handshake checks, message exchange, bad peers, liveness. All on 127.0.0.1, port 0."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import msgspec

from connector.core.errors import ControlError, FrameError
from connector.core.layout import Region
from connector.core.untrusted import is_id
from connector.protocol.auth import identity, new_nonce
from connector.protocol.messages import (HEADER, PROTOCOL_VERSION, Abort, Auth, Complete, Error, Heartbeat, Hello,
                                         Register, RegisterAck, RegisterError, Reject, Welcome, decode_frame,
                                         encode_body, encode_frame)
from connector.transport.connection import ControlConnection
from connector.transport.control import ControlServer
from connector.transport.client import connect
from connector.transport.limits import ServerLimits
from tests.helpers import QuietHandler, bare_side_channel

pytestmark = pytest.mark.timeout(20)

FP = "0123456789abcdef"
BARE = bare_side_channel()
"""The side channel with no heartbeats and no dead-peer timeout (what these tests start from)."""
LOG = "connector.transport.control"


def regions() -> list[Region]:
    return [
        Region(pool="kv", layer=30, slot=0, base_addr=0x7F00_0000_0000, num_blocks=64, bytes_per_block=65536,
               block_stride=65536, heads=(0, 4), num_parts=2, part_stride=64 * 65536, device_id=0),
        Region(pool="index_k", layer=30, slot=0, base_addr=0x7F10_0000_0000, num_blocks=64, bytes_per_block=8192,
               block_stride=8192, heads=(0, 1)),
    ]


def hello(role: str = "decode", *, fingerprint: str = FP, version: int = PROTOCOL_VERSION,
          engine: str = "eng") -> Hello:
    """A rank's full Hello (memory included), as the engines build it: `connect` sends only what the protocol
    needs."""
    return Hello(role=role, engine_id=f"{engine}-{role}", pp_rank=0, tp_rank=1, pp_size=1, tp_size=2,
                 fingerprint=fingerprint, block_size=64, agent_name=f"agent-{role}", agent_metadata=b"\x00\xffmeta",
                 regions=regions(), version=version)


def as_received(h: Hello) -> Hello:
    """`h` as the server's on_hello gets it (its memory from Auth, no nonce or lane tag to compare)."""
    return msgspec.structs.replace(h, nonce=b"", proof=b"", lane=b"")


SAMPLES = [
    msgspec.structs.replace(identity(hello()), nonce=new_nonce()),
    Auth(proof=b"p" * 32, agent_metadata=b"\x00meta", regions=regions(), staging_bytes=4096),
    Welcome(),
    Reject("nope"),
    Register("t1", dst_pp=0, dst_tp=1, block_ids=[[1, 2, 3], [7]], first_token=64, num_tokens=1000),
    RegisterAck("t1"),
    RegisterError("t1", "no such request"),
    Complete("t1", src_pp=1, src_tp=0, bytes_written=1 << 40, descriptors=117),
    Abort("t1", "client went away"),
    Heartbeat(["t1", "t2"]),
    Heartbeat(),
    Error("bad"),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_roundtrip_every_type(msg):
    assert decode_frame(encode_frame(msg)) == msg


ids = st.text(st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Zl", "Zp")), max_size=40).filter(is_id)
"""Ids the wire takes: no control, separator or bidi character (connector.core.untrusted.ID_PATTERN; a frame with
one is refused, tests/test_log_forging.py)."""
i64 = st.integers(min_value=0, max_value=2**63 - 1)


@settings(max_examples=60, deadline=None)
@given(st.builds(Register, ids, st.integers(0, 64), st.integers(0, 64),
                 st.lists(st.lists(st.integers(0, 2**31 - 1)), max_size=4), i64, i64))  # ids are int32 on the wire
def test_roundtrip_register_property(msg):
    assert decode_frame(encode_frame(msg)) == msg


@settings(max_examples=60, deadline=None)
@given(st.builds(Complete, ids, st.integers(0, 64), st.integers(0, 64), i64, i64),
       st.builds(Heartbeat, st.lists(ids, max_size=8)))
def test_roundtrip_complete_heartbeat_property(complete, heartbeat):
    assert decode_frame(encode_frame(complete)) == complete
    assert decode_frame(encode_frame(heartbeat)) == heartbeat


def test_decode_rejects_bad_frames():
    with pytest.raises(FrameError, match="exceeds the 10-byte limit"):
        decode_frame(encode_frame(Error("x" * 20)), max_frame_bytes=10)
    with pytest.raises(FrameError, match=f"protocol version {PROTOCOL_VERSION + 1}"):
        decode_frame(encode_frame(Error("x"), version=PROTOCOL_VERSION + 1))
    body = encode_body(Error("x"))
    with pytest.raises(FrameError, match="malformed msgpack"):
        decode_frame(HEADER.pack(3, PROTOCOL_VERSION) + b"\xc1\xc1\xc1")
    with pytest.raises(FrameError, match="invalid message"):
        decode_frame(HEADER.pack(len(body), PROTOCOL_VERSION) + body.replace(b"error", b"wrong"))


class App(QuietHandler):
    """Prefill-side application: acks registrations, then reports completion; fails on request."""

    def __init__(self) -> None:
        self.hellos: list[Hello] = []
        self.received: list = []

    def on_hello(self, peer: Hello) -> None:
        if peer.engine_id.startswith("banned"):
            raise ValueError(f"engine {peer.engine_id} is banned")
        self.hellos.append(as_received(peer))

    async def on_message(self, conn: ControlConnection, msg) -> None:
        self.received.append(msg)
        if isinstance(msg, Register):
            if msg.transfer_id == "explode":
                raise RuntimeError("registration table is on fire")
            await conn.send(RegisterAck(msg.transfer_id))
            await conn.send(Complete(msg.transfer_id, src_pp=0, src_tp=0, bytes_written=4096, descriptors=2))
        elif isinstance(msg, Abort):
            raise KeyError(msg.transfer_id)


def server(app: App, **kw) -> ControlServer:
    """A server of the bare side channel (`kw`: SideChannelConfig fields), no heartbeats unless asked."""
    return ControlServer(hello("prefill"), app, bare_side_channel(**kw))


async def raw_exchange(port: int, data: bytes, timeout: float = 2.0) -> tuple[bytes, float]:
    """Write raw bytes, read until the server closes; return what came back and how long that took."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    writer.write(data)
    await writer.drain()
    reply = b""
    async with asyncio.timeout(timeout):
        try:
            while chunk := await reader.read(65536):
                reply += chunk
        except ConnectionResetError:  # the server closed with our unread bytes in its buffer
            pass
    writer.close()
    return reply, time.monotonic() - start


async def assert_still_serves(port: int) -> None:
    async with await connect("127.0.0.1", port, hello(), BARE, timeout=2) as conn:
        await conn.send(Register("ok", 0, 1, [[1]], 0, 10))
        assert await conn.recv(2) == RegisterAck("ok")


async def test_handshake_with_regions():
    app = App()
    async with server(app) as srv:
        assert srv.port > 0
        async with await connect("127.0.0.1", srv.port, hello(), BARE, timeout=2) as conn:
            # least privilege: the server tells who it is, never its NIXL metadata or its memory's addresses
            assert as_received(conn.peer) == identity(hello("prefill"))
            assert conn.peer.agent_metadata == b"" and conn.peer.regions == []
            # decode's memory reaches the server (in Auth, after the handshake checks)
            assert [msgspec.structs.replace(h, lane=b"") for h in app.hellos] == [hello()]
            [server_side] = srv.connections
            assert server_side.peer.regions == regions() and server_side.peer.regions[0].heads == (0, 4)


async def test_register_ack_complete_and_heartbeat():
    app = App()
    async with server(app) as srv:
        async with await connect("127.0.0.1", srv.port, hello(), BARE, timeout=2) as conn:
            reg = Register("t1", dst_pp=0, dst_tp=1, block_ids=[[5, 6], [9]], first_token=64, num_tokens=200)
            await conn.send(reg)
            assert await conn.recv(2) == RegisterAck("t1")
            assert await conn.recv(2) == Complete("t1", src_pp=0, src_tp=0, bytes_written=4096, descriptors=2)
            await conn.send(Heartbeat(["t1"]))
            await conn.send(Heartbeat([]))  # liveness only: not delivered
            await conn.send(Register("t2", 0, 1, [[1]], 0, 1))
            assert await conn.recv(2) == RegisterAck("t2")
            assert app.received == [reg, Heartbeat(["t1"]), Register("t2", 0, 1, [[1]], 0, 1)]


async def test_wrong_fingerprint_rejected_and_server_keeps_serving(caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    async with server(App()) as srv:
        with pytest.raises(ControlError) as err:
            await connect("127.0.0.1", srv.port, hello(fingerprint="feedfacefeedface"), BARE, timeout=2)
        assert "feedfacefeedface" in str(err.value) and FP in str(err.value)
        for _ in range(100):  # decode refused prefill's Hello (it compares the models): prefill hears it at once
            if any(r.message.startswith("closing 127.0.0.1:") and "fingerprint" in r.message for r in caplog.records):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError([r.message for r in caplog.records])
        await assert_still_serves(srv.port)


@pytest.mark.parametrize("data, reason", [
    (HEADER.pack(3, PROTOCOL_VERSION) + b"\xc1\xc1\xc1", "malformed msgpack"),
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "exceeds the 1048576-byte limit"),
    (encode_frame(Register("t", 0, 0, [], 0, 0)), "first frame is Register, expected Hello"),
])
async def test_garbage_is_logged_and_closed(caplog, data, reason):
    caplog.set_level(logging.INFO, logger=LOG)
    async with server(App()) as srv:
        reply, _ = await raw_exchange(srv.port, data)
        if reply or "GET" not in repr(data):  # a reset may swallow the Reject when our bytes were left unread
            assert reason in decode_frame(reply).reason
        assert [r for r in caplog.records if r.message.startswith("closing 127.0.0.1:") and reason in r.message]
        await assert_still_serves(srv.port)


async def test_huge_length_closed_before_reading_body(caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    async with server(App(), handshake_timeout_s=10) as srv:
        reply, elapsed = await raw_exchange(srv.port, HEADER.pack(2**31 - 1, PROTOCOL_VERSION))
        assert elapsed < 2  # did not wait for 2 GiB (or the 10 s handshake timeout)
        assert isinstance(decode_frame(reply), Reject)
        assert any("frame of 2147483647 bytes exceeds the 1048576-byte limit" in r.message for r in caplog.records)


async def test_unknown_version(caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    async with server(App()) as srv:
        reply, _ = await raw_exchange(srv.port, encode_frame(hello(), version=99))
        assert "protocol version 99" in decode_frame(reply).reason
        other = PROTOCOL_VERSION + 1  # a Hello from a newer peer: refused, naming its version
        with pytest.raises(ControlError, match=f"protocol version {other}"):
            await connect("127.0.0.1", srv.port, hello(version=other), BARE, timeout=2)
        assert sum("closing 127.0.0.1:" in r.message for r in caplog.records) == 2
        await assert_still_serves(srv.port)


async def test_auth(caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    app = App()
    async with server(app, auth_token="s3cret") as srv:
        with pytest.raises(ControlError, match="proof of the auth_token is wrong"):
            await connect("127.0.0.1", srv.port, hello(), bare_side_channel(auth_token="guess"), timeout=2)
        with pytest.raises(ControlError, match="bad auth token"):
            await connect("127.0.0.1", srv.port, hello(), BARE, timeout=2)
        assert any("bad auth token" in r.message for r in caplog.records)
        token = bare_side_channel(auth_token="s3cret")
        async with await connect("127.0.0.1", srv.port, hello(), token, timeout=2) as conn:
            assert len(conn.peer.proof) == 32 and [c.peer.proof for c in srv.connections] == [b""]
    async with server(app) as srv:  # decode with a token refuses a prefill without one
        with pytest.raises(ControlError, match="did not prove it knows the auth_token"):
            await connect("127.0.0.1", srv.port, hello(), token, timeout=2)


async def test_role_and_on_hello_rejections():
    async with server(App()) as srv:
        with pytest.raises(ControlError, match="roles must differ"):
            await connect("127.0.0.1", srv.port, hello("prefill"), BARE, timeout=2)
        with pytest.raises(ControlError, match="banned"):
            await connect("127.0.0.1", srv.port, hello(engine="banned"), BARE, timeout=2)
        await assert_still_serves(srv.port)


async def test_handshake_timeout(caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    async with server(App(), handshake_timeout_s=0.3) as srv:
        reply, elapsed = await raw_exchange(srv.port, b"", timeout=3)
        assert reply == b"" and 0.25 < elapsed < 2
        assert any("no complete handshake within the 0.3 s handshake timeout" in r.message for r in caplog.records)
        await assert_still_serves(srv.port)


async def test_handler_exception_answered_and_connection_survives(caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    async with server(App()) as srv:
        async with await connect("127.0.0.1", srv.port, hello(), BARE, timeout=2) as conn:
            await conn.send(Register("explode", 0, 1, [[1]], 0, 10))
            answer = await conn.recv(2)
            assert isinstance(answer, RegisterError) and answer.transfer_id == "explode"
            assert "on fire" in answer.reason
            await conn.send(Abort("t9", "bye"))
            answer = await conn.recv(2)
            assert isinstance(answer, Error) and "KeyError" in answer.reason
            await conn.send(Register("fine", 0, 1, [[1]], 0, 10))
            assert await conn.recv(2) == RegisterAck("fine")
        assert any(r.levelno == logging.ERROR and "handler for Register" in r.message for r in caplog.records)
        await assert_still_serves(srv.port)


async def test_silent_peer_detected_by_dead_after(caplog):
    caplog.set_level(logging.INFO, logger=LOG)
    async with server(App()) as srv:
        reasons: list[str] = []
        start = time.monotonic()
        # Client expects the server to heartbeat; it does not, so the client declares it dead.
        conn = await connect("127.0.0.1", srv.port, hello(), bare_side_channel(dead_after_s=0.3), timeout=2,
                             on_close=reasons.append)
        with pytest.raises(ControlError, match="silent"):
            await conn.recv(5)  # fails promptly instead of waiting the full 5 s
        elapsed = time.monotonic() - start
        assert 0.25 < elapsed < 3  # far below the 5 s the recv would otherwise wait
        assert reasons == [conn.close_reason] and "dead_after" in reasons[0]
        assert await asyncio.wait_for(conn.closed, 1) == reasons[0]
        await conn.aclose()
        await conn.aclose()  # idempotent
        assert len(reasons) == 1
        assert any("peer silent" in r.message and r.message.startswith("closing 127.0.0.1:") for r in caplog.records)


async def test_heartbeats_keep_connection_alive_and_server_drops_silent_client():
    async with server(App(), dead_after_s=0.3) as srv:
        beating = bare_side_channel(heartbeat_interval_s=0.05)
        async with await connect("127.0.0.1", srv.port, hello(), beating, timeout=2) as alive:
            silent = await connect("127.0.0.1", srv.port, hello(), BARE, timeout=2)
            await asyncio.sleep(0.8)
            assert not alive.is_closed
            assert [as_received(c.peer) for c in srv.connections] == [hello()]  # the silent one was dropped
            with pytest.raises(ControlError, match="peer closed"):
                await silent.recv(1)
            await silent.aclose()
            await alive.send(Register("hb", 0, 1, [[1]], 0, 10))
            assert await alive.recv(2) == RegisterAck("hb")


async def test_server_close_closes_connections():
    app = App()
    srv = server(app)
    await srv.start()
    conn = await connect("127.0.0.1", srv.port, hello(), BARE, timeout=2)
    await srv.aclose()
    with pytest.raises(ControlError):
        await conn.recv(2)
    await conn.aclose()
    with pytest.raises(ControlError, match="closed"):
        await conn.send(Heartbeat())
    with pytest.raises(ControlError, match="cannot connect"):
        await connect("127.0.0.1", srv.port, hello(), BARE, timeout=1)


async def test_deep_nesting_is_a_refused_frame_without_a_traceback(caplog):
    """A value nested 100,000 deep used to escape the codec as RecursionError (an ERROR traceback per frame). It is
    a FrameError: answered with Reject, counted as a refused frame, no ERROR record."""
    caplog.set_level(logging.INFO)
    head = msgspec.msgpack.encode({"type": "hello", "junk": 0})[:-1]
    body = head + b"\x91" * 100_000 + b"\x90"
    async with server(App()) as srv:
        reply, _ = await raw_exchange(srv.port, HEADER.pack(len(body), PROTOCOL_VERSION) + body)
        assert "nested too deeply" in decode_frame(reply).reason
        assert srv.refusals.counts["frame"] == 1
        await assert_still_serves(srv.port)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records


async def test_refusals_are_logged_at_a_bounded_rate_and_counted(caplog):
    """Each refused connection used to be one WARNING line (an outsider wrote megabytes a second). Now the first
    few of an interval are logged, the rest counted and summed up in one line at the interval's end."""
    caplog.set_level(logging.WARNING, logger=LOG)
    async with server(App(), limits=ServerLimits(refusal_log_interval_s=0.5)) as srv:
        for _ in range(40):
            await raw_exchange(srv.port, encode_frame(Register("t", 0, 0, [], 0, 0)))
        await asyncio.sleep(0.7)
        assert srv.refusals.counts["refused"] == 40  # (a wrong first frame is refused by the Hello check)
        lines = [r.message for r in caplog.records if "127.0.0.1" in r.message or "more connections" in r.message]
        assert len(lines) == 6, lines
        assert "35 more connections refused or failed in the last 0.5 s (35 refused" in lines[-1]


async def test_a_full_pending_budget_evicts_the_oldest_not_the_newcomer():
    """Idle connections from one address used to hold the handshake slots: a newcomer was refused. Now the
    address's oldest pending connection is closed and the newcomer handshakes."""
    async with server(App(), limits=ServerLimits(max_handshakes_per_host=2)) as srv:
        idle = [await asyncio.open_connection("127.0.0.1", srv.port) for _ in range(5)]
        await asyncio.sleep(0.1)
        assert srv.guard.handshakes == 2 and srv.refusals.counts["evicted"] == 3
        await assert_still_serves(srv.port)
        for _reader, writer in idle:
            writer.close()

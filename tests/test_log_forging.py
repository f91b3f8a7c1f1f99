"""Log forging (issue 33, item 5): strings a peer sends must reach logs and error messages escaped and bounded.

Before the fix, a real prefill process (its own process, auth token set, real NIXL) wrote them raw: a transfer id in
the `for_transfer` of a Hello that fails authentication (anyone can send one), a token holder's Register or Abort
(its transfer id, its reason), the reason of a Reject sent in place of Auth (\\n was replaced, \\r and ESC were
not), and the type tag of an undecodable frame (msgspec echoes it raw, newline and all): a newline in any of them
wrote whole forged lines, an ESC sequence reached the terminal of whoever reads the log, and a 64 KiB reason made a
64 KiB line. Here every kind is sent over real sockets, raw, as an attacker does, and prefill's own stderr (its log)
is read back: no forged line, no raw control character, no line longer than LONGEST, and what was sent still
recognisable, escaped (or, for an id, the frame refused naming the field).

`shown` (connector.core.untrusted), the one function that renders peer text, is checked on its own in a table."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time

import msgspec
import pytest

from connector.engine.config import SenderConfig
from connector.protocol.auth import identity, new_nonce
from connector.protocol.messages import (HEADER, PROTOCOL_VERSION, Abort, Register, Reject, decode_body,
                                         encode_frame)
from sparse_kv_lab.sim.cluster import Cluster
from connector.transport.client import connect
from connector.transport.limits import ServerLimits
from connector.transport.side_channel import SideChannelConfig
from tests.adversary import TOKEN, WITH_TOKEN, Target, blocks, guess, hello_frame, make_scenario, read_message
from tests.test_security import decode_config

pytestmark = [pytest.mark.timeout(120)]

STAMP = "2026-12-04 00:00:00,000"
FORGED = f"{STAMP} prefill ERROR connector.fake: forged line"
KINDS = {
    "newline": "\n" + FORGED,
    "cr": "\r" + FORGED,
    "control": "\x00\x07\x08\x7f\x85\x9b" + FORGED,
    "ansi": "\x1b[2K\x1b[1G" + FORGED + "\x1b[0m\x1b]0;title\x07",
    "u2028": "\u2028" + FORGED + "\u2029",
    "bidi": "\u202e" + FORGED + "\u2066\u2069\u200f",
    "64k": "A" * 65536,
}
RAW = "\r\x00\x07\x08\x7f\x85\x9b\x1b\u2028\u2029\u202e\u2066\u2069\u200f"
"""Characters that must never reach the log raw (newlines are the lines' own ends)."""
ESCAPED = {"newline": r"\x0a" + STAMP, "cr": r"\x0d" + STAMP, "control": r"\x00\x07\x08\x7f\x85\x9b" + STAMP,
           "ansi": r"\x1b[2K\x1b[1G" + STAMP, "u2028": r"\u2028" + STAMP, "bidi": r"\u202e" + STAMP,
           "64k": "AAAA"}
"""How each payload shows in the log: escaped (or cut, with the count of what was left out)."""
LONGEST = 16384
"""No line of prefill's log may be longer (a 64 KiB name must not make a 64 KiB line)."""
_tags = itertools.count()


@pytest.fixture(scope="module")
def prefill(m3, tmp_path_factory):
    """A real prefill process (token set) whose stderr, its log at INFO, goes to a file: (Target, log path).
    Refusals are logged one by one here (a tiny refusal_log_interval_s), so none hides in a summary line."""
    from sparse_kv_lab.sim.env import apply_env

    apply_env()
    path = tmp_path_factory.mktemp("forging") / "prefill.log"
    limits = ServerLimits(refusal_log_interval_s=0.001, auth_failure_delay_s=0.01)
    config = SenderConfig(lease_s=6.0, write_timeout_s=30.0,
                          side_channel=SideChannelConfig(auth_token=TOKEN, limits=limits))
    root = logging.getLogger()
    level = root.level
    saved = os.dup(2)
    try:
        with open(path, "wb") as f:
            os.dup2(f.fileno(), 2)  # the worker inherits fd 2 when it is spawned
        root.setLevel(logging.INFO)  # the worker logs at the parent's root level
        cluster = Cluster(make_scenario(m3, sender_config=config), spawn=("prefill",))
        cluster.__enter__()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        root.setLevel(level)
    try:
        yield Target(cluster), path
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def mallory(prefill, m3):
    """A token holder's decode rank, in this process (its own NIXL agent)."""
    from sparse_kv_lab.sim.rank import SimRank

    target, _path = prefill
    with SimRank(target.cluster.sc.rank_spec("decode", (0, 0), run_id="mallory")) as rank:
        rank.receiver(decode_config())
        yield rank


def log_since(path, offset: int) -> str:
    """Prefill's log from `offset` on, once it stopped growing (its lines may trail the answers on the socket)."""
    size, still = -1, 0
    deadline = time.monotonic() + 5.0
    while still < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
        now = os.path.getsize(path)
        still = still + 1 if now == size else 0
        size = now
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", "replace")


def assert_not_forged(text: str, kind: str, expect: list[str]) -> None:
    lines = text.splitlines()  # what splits a line for Python also splits it for a log reader: \r, \x85, \u2028...
    forged = [line for line in lines if line.startswith(STAMP) or line.lstrip("\x00\x07\x08\x7f").startswith(STAMP)]
    assert not forged, f"{kind}: forged lines in prefill's log: {forged[:3]!r}"
    raw = sorted({c for c in text if c in RAW})
    assert not raw, f"{kind}: raw {raw!r} in prefill's log: " + repr([line[:300] for line in lines
                                                                     if any(c in line for c in RAW)][:3])
    long = [len(line) for line in lines if len(line) > LONGEST]
    assert not long, f"{kind}: lines of {long} characters in prefill's log"
    for what in expect:
        assert what in text, f"{kind}: {what!r} not in prefill's log:\n{text[-3000:]}"


async def token_holder(rank, port: int, *msgs) -> list:
    """A token holder's connection: send each of `msgs` and read one answer to each (or how it ended)."""
    conn = await connect("127.0.0.1", port, rank.engine.hello, WITH_TOKEN, timeout=10)
    out = []
    try:
        for msg in msgs:
            await conn.send(msg)
            try:
                out.append(await conn.recv(5))
            except Exception as exc:  # noqa: BLE001 - refused frames close the connection: that is an answer too
                out.append(f"{type(exc).__name__}: {exc}")
                break
    finally:
        await conn.aclose()
    return out


async def reject_instead_of_auth(port: int, hello, reason: str) -> None:
    """Anyone: a Hello, then, in place of Auth, a Reject whose reason is `reason` (prefill logs why decode left)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(hello_frame(hello))
        await read_message(reader)
        writer.write(encode_frame(Reject(reason)))
        await writer.drain()
        await asyncio.wait_for(reader.read(), 5)
    except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
        pass
    finally:
        writer.close()


async def bad_tag(port: int, tag: str) -> list:
    """Anyone: a frame whose type tag is no message's (msgspec names the tag it refuses)."""
    body = msgspec.msgpack.encode({"type": tag})
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(HEADER.pack(len(body), PROTOCOL_VERSION) + body)
        await writer.drain()
        length, _ = HEADER.unpack(await asyncio.wait_for(reader.readexactly(HEADER.size), 5))
        return [decode_body(await reader.readexactly(length))]
    except (ConnectionError, asyncio.IncompleteReadError, TimeoutError) as exc:
        return [repr(exc)]
    finally:
        writer.close()


@pytest.mark.parametrize("kind", list(KINDS))
def test_peer_strings_reach_prefills_log_escaped_and_bounded(prefill, mallory, kind):
    """Each kind of payload, sent by an outsider (a Hello that fails authentication naming it as `for_transfer`, a
    Hello whose engine id carries it, a Reject in place of Auth giving it as the reason, a frame whose type tag it
    is) and by a token holder (a Register and an Abort whose transfer id carries it, an Abort whose reason is it):
    prefill's log has no forged line, no raw control character and no overlong line, and still shows the payload
    escaped, or names the field of the frame it refused."""
    target, path = prefill
    payload, n = KINDS[kind], next(_tags)
    tid = f"t-{kind}-{n}" + payload[:400]  # within MAX_TRANSFER_ID: what is refused is the characters
    hello = mallory.engine.hello
    offset = os.path.getsize(path)

    outsider = msgspec.structs.replace(hello, engine_id=f"decode-outsider-{n}")
    answer = mallory.run(guess(target.port, msgspec.structs.replace(outsider, for_transfer=tid), "wrong-token"), 30)
    assert "Reject" in answer, answer
    named = msgspec.structs.replace(hello, engine_id=f"decode-{n}" + payload[:200])
    mallory.run(guess(target.port, named, "wrong-token"), 30)
    mallory.run(reject_instead_of_auth(target.port, msgspec.structs.replace(outsider, engine_id=f"decode-r-{n}"),
                                       f"reason-{n}" + payload), 30)
    mallory.run(bad_tag(target.port, f"tag-{n}" + payload), 30)

    block_ids = blocks(mallory.spec.num_blocks, 3)
    mallory.run(token_holder(mallory, target.port, Register(tid, 0, 0, block_ids, 0, 64, after_prefill=True)), 30)
    mallory.run(token_holder(mallory, target.port, Abort(tid, "gave up")), 30)
    mallory.run(token_holder(mallory, target.port, Abort(f"t-abort-{n}", f"abort-reason-{n}" + payload)), 30)

    text = log_since(path, offset)
    expect = [f"abort-reason-{n}{ESCAPED[kind]}", f"reason-{n}{ESCAPED[kind]}", f"tag-{n}"]
    assert_not_forged(text, kind, expect)
    if kind == "64k":
        assert re.search(rf"abort-reason-{n}A{{100,}}…\(\+\d+ chars\)", text), "the reason is not cut, or not said so"
    target.wait_state("the attacks' connections gone", lambda s: s["handshakes"] == 0 and s["requests"] == 0)


def test_a_legitimate_transfer_id_is_still_served_and_logged_as_it_is(prefill, mallory):
    """Printable ids (Unicode included: vLLM request ids come from clients) pass and show unchanged."""
    target, path = prefill
    offset = os.path.getsize(path)
    tid = "t-ünïcødé-請求-ok"
    answers = mallory.run(token_holder(mallory, target.port, Abort(tid, "gave up: ok")), 30)
    assert [type(a).__name__ for a in answers] == ["Stopped"], answers
    assert f"transfer {tid}: decode" in log_since(path, offset)


# ---- the function, and the wire types ------------------------------------------------------------------------------
@pytest.mark.parametrize("text, limit, want", [
    ("t-plain-id", 512, "t-plain-id"),
    ("t-ünïcødé-請求", 512, "t-ünïcødé-請求"),  # printable Unicode stays as it is
    ("a\nb", 512, r"a\x0ab"),
    ("a\r\nb", 512, r"a\x0d\x0ab"),
    ("\x00\x07\x08\t\x7f", 512, r"\x00\x07\x08\x09\x7f"),
    ("\x85\x9b", 512, r"\x85\x9b"),  # C1: NEL and the 8-bit CSI
    ("\x1b[31mred\x1b[0m", 512, r"\x1b[31mred\x1b[0m"),
    ("a\u2028b\u2029c", 512, r"a\u2028b\u2029c"),
    ("\u202eevil\u202c\u2066\u2069\u200f\u061c\ufeff", 512, r"\u202eevil\u202c\u2066\u2069\u200f\u061c\ufeff"),
    ("\U000e0001tag", 512, r"\U000e0001tag"),  # a language tag (format, outside the BMP)
    ("A" * 65536, 100, "A" * 100 + "…(+65436 chars)"),
    ("\n" * 50, 20, r"\x0a" * 5 + "…(+45 chars)"),  # the escapes count against the bound
    ("back\\slash", 512, "back\\slash"),  # left alone: shown text shown again is unchanged
    (7, 512, "7"),
])
def test_shown_escapes_and_bounds(text, limit, want):
    from connector.core.untrusted import shown

    got = shown(text, limit)
    assert got == want
    assert got.isprintable() and len(got) <= limit + len("…(+65536 chars)")
    assert shown(got, 10 * limit) == got  # idempotent under a larger bound


def test_shown_quoted_reads_as_repr_for_plain_text():
    from connector.core.untrusted import shown

    assert shown("decode-victim", quote=True) == repr("decode-victim")
    assert shown("it's\n", quote=True) == r"'it\'s\x0a'"


@pytest.mark.parametrize("text, ok", [
    ("t-1", True), ("", True), ("請求 id with spaces", True), ("a" * 600, True),  # (the length is each type's own)
    ("a\n", False), ("a\nb", False), ("\r", False), ("\x1b[2K", False), ("\x85", False), ("\x7f", False),
    ("\u2028", False), ("\u202e", False), ("\u2066", False), ("\u200b", False), ("\ufeff", False), (7, False),
])
def test_is_id(text, ok):
    from connector.core.untrusted import is_id

    assert is_id(text) is ok


@pytest.mark.parametrize("bad", ["\n" + FORGED, "x\n", "\r", "\x1b[2K", "\x9b", "\u2028", "\u202e"])
def test_frames_with_such_ids_are_refused_naming_the_field_never_echoing_it(bad):
    """An id holding a control, separator or bidi character (even one trailing newline, which `$` would let by)
    makes the frame a bad frame; the refusal names the field and not the value. A type tag msgspec refuses (it
    names it raw) is shown escaped and cut."""
    from connector.core.errors import FrameError
    from connector.protocol.messages import PoolLayout

    for msg, field in ((Register(bad, 0, 0, [[1]], 0, 16), "$.transfer_id"), (Abort(bad, "r"), "$.transfer_id"),
                       (msgspec.structs.replace(hello_like(), for_transfer=bad), "$.for_transfer"),
                       (msgspec.structs.replace(hello_like(), engine_id=bad), "$.engine_id")):
        frame = encode_frame(msg)
        with pytest.raises(FrameError) as err:
            decode_body(frame[HEADER.size:])
        assert field in str(err.value) and bad not in str(err.value) and str(err.value).isprintable(), err.value
        assert "without control, separator or bidi characters" in str(err.value)
    layout = PoolLayout("kv\n", [0], 1, 1, 1, True)
    with pytest.raises(FrameError, match="layout"):
        decode_body(msgspec.msgpack.encode(msgspec.structs.replace(hello_like(), layout=[layout])))
    spec = PoolLayout("kv", [0], 1, 1, 1, True, spec=bad[:60])
    with pytest.raises(FrameError, match="spec"):
        decode_body(msgspec.msgpack.encode(msgspec.structs.replace(hello_like(), layout=[spec])))
    with pytest.raises(FrameError) as err:
        decode_body(msgspec.msgpack.encode({"type": "t" + bad + "A" * 65536}))
    assert str(err.value).isprintable() and len(str(err.value)) < 2100, str(err.value)[:300]


def hello_like():
    from connector.protocol.messages import Hello

    return Hello("decode", "decode-x", 0, 0, 1, 1, "fp", 16, "agent-x", nonce=new_nonce())


def test_a_request_whose_transfer_id_no_id_can_be_fails_before_it_reaches_the_side_channel():
    """kv_transfer_params come from the client: a transfer id that the side channel would refuse (its frame would
    close the connection, with every transfer on it) fails the one request instead, named escaped; a bad secret
    is never echoed, not even its first characters."""
    from connector.vllm.requests import check_params

    why = check_params({"transfer_id": "t\n" + FORGED, "prefill_addr": "127.0.0.1:5600"}, decode=True)
    assert "control" in why and r"t\x0a" + STAMP in why and why.isprintable(), why
    why = check_params({"transfer_id": "t-1", "prefill_addr": "evil\n" + FORGED + ":5600"}, decode=True)
    assert "is not host:port" in why and why.isprintable(), why
    why = check_params({"transfer_id": "t-1", "transfer_secret": "s3cr3t-" + "x" * 5000}, decode=False)
    assert "s3cr3t" not in why and "never shown" in why, why
    why = check_params({"transfer_id": ["\n" + FORGED] * 10000, "prefill_addr": "127.0.0.1:5600",
                        "\x1b[2K": 1}, decode=True)
    assert why.isprintable() and len(why) < 1500, why[:300]

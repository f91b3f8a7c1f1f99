"""The side channel's handshake over a socket (the messages and proofs are connector.protocol): the client's half
(`client_handshake`) and the server's (`ServerHandshake`), and reading one frame. Used by
connector.transport.control, which owns the connections."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from connector.core.errors import AuthFailed, ControlError, InputError, PeerGaveUp, Probed, Unanswered
from connector.core.untrusted import shown, shown_text
from connector.protocol.auth import (check_claim, check_client_proof, check_engine_signature, check_lane,
                                     check_prefill_key, check_server_proof, client_proof, engine_public_key,
                                     engine_signature, hint_matches, identity, lane_tag, memory_of, new_nonce,
                                     opening, prefill_signature, server_proof, session_of, transfer_hint)
from connector.protocol.handshake import check_hello, check_opening
from connector.protocol.messages import (DEFAULT_MAX_FRAME_BYTES, HANDSHAKE_MAX_FRAME_BYTES, HEADER, Auth, Hello,
                                         Message, Reject, Welcome, check_header, decode_body, encode_frame)
from connector.transport.admission import AdmissionGuard, Pending
from connector.transport.limits import ServerLimits

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 500
"""Most characters of a peer's own refusal reason that are logged (it is the peer's text)."""


PeekHook = Callable[[Hello], None]
"""Called with who a peer says it is, once its proofs checked out and before its memory is taken up (cheap checks
only); raise to refuse it."""


def format_addr(addr: Any) -> str:
    """`host:port` (IPv6 as `[host]:port`) from a socket peername."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(addr)


async def read_frame(reader: asyncio.StreamReader, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """Read one frame. The header is checked (size, version) before the body is read.
    Raises FrameError for a bad frame, asyncio.IncompleteReadError on EOF."""
    length = check_header(await reader.readexactly(HEADER.size), max_frame_bytes)
    return decode_body(await reader.readexactly(length))


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: Hello,
                            auth_token: str, where: str, for_transfer: str = "",
                            check: PeekHook | None = None, engine_key: bytes = b"",
                            trusted_prefill_keys: frozenset[bytes] = frozenset()) -> tuple[Hello, bytes]:
    """The client's half of the handshake; returns the server's Hello and the connection's nonces
    (connector.protocol.auth.session_of). `for_transfer`: the transfer this connection is opened for (the server
    frees its KV at once if it refuses the handshake). `check`: called with the server's Hello once its proof checked
    out and before anything about our memory leaves (the peer's claimed layout); raise to refuse it. `engine_key`:
    the private key of `hello.engine_key` (protocol.auth), which signs this connection's transcript.
    `trusted_prefill_keys`: if any, the server must prove one of them (protocol.auth.check_prefill_key), also
    before our memory leaves."""
    claim = msgspec.structs.replace(identity(hello), nonce=new_nonce(), for_transfer=for_transfer,
                                    lane=lane_tag(auth_token, hello))
    ours = opening(claim)  # who we are waits for the proofs (decode speaks second)
    writer.write(encode_frame(ours))
    await writer.drain()
    reply = _expect(await read_frame(reader, HANDSHAKE_MAX_FRAME_BYTES), Hello, where)
    try:
        check_hello(reply, hello)
        check_server_proof(auth_token, ours, reply)  # before a byte about who we are or our memory leaves
        check_prefill_key(trusted_prefill_keys, ours, reply)  # a token holder is not a prefill
        if check is not None:
            check(reply)  # so is the layout it claims (a fake prefill of 4096 ranks learns nothing of ours)
    except (ControlError, InputError) as exc:
        # Tell prefill why (else it sees only a closed connection), then give up. The transfer we came for goes
        # only as a digest bound to this connection: the prefill that holds it frees its KV, a listener learns
        # nothing.
        hint = transfer_hint(session_of(ours, reply), for_transfer) if for_transfer else b""
        with contextlib.suppress(Exception):
            writer.write(encode_frame(Reject(str(exc), transfer_hint=hint)))
            async with asyncio.timeout(1.0):
                await writer.drain()
        raise ControlError(f"{where}: {exc}") from None
    auth = memory_of(hello, claim=claim)
    if hello.engine_key:
        auth = msgspec.structs.replace(auth, engine_signature=engine_signature(engine_key, ours, reply, claim))
    if auth_token:
        auth = msgspec.structs.replace(auth, proof=client_proof(auth_token, ours, reply, auth))
    writer.write(encode_frame(auth))
    await writer.drain()
    _expect(await read_frame(reader, HANDSHAKE_MAX_FRAME_BYTES), Welcome, where)
    return reply, session_of(ours, reply)


def _expect(msg: Message, kind: type, where: str) -> Any:
    if isinstance(msg, Reject):
        raise ControlError(f"{where} rejected the handshake: {shown_text(msg.reason)}")
    if not isinstance(msg, kind):
        raise ControlError(f"{where} answered the handshake with {type(msg).__name__} where {kind.__name__} was "
                           f"due: {msg!r}"[:2000])
    return msg


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost" (what only this machine can reach)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class Attempt:
    """What one connection's handshake got so far (the server reports a refused peer by its first Hello)."""

    first: Hello | None = None
    """The peer's Hello, once read: its opening (no identity), then who its Auth says it is (also one that a later
    check refuses)."""
    nonces: bytes = b""
    """The connection's two nonces (connector.protocol.auth.session_of), once our Hello is out."""
    hint: bytes = b""
    """A decode that refused our Hello: the transfer it came for, as a digest (Reject.transfer_hint)."""

    def came_for(self, transfer_id: str) -> bool:
        """Whether the peer connected for `transfer_id`: its claim names it, or its refusal's hint matches it."""
        if self.first is not None and self.first.for_transfer:
            return self.first.for_transfer == transfer_id
        return hint_matches(self.hint, self.nonces, transfer_id)


class ServerHandshake:
    """The server's half: the peer's opening Hello in (version, role, model: it says nothing of who it is), our
    identity with a fresh nonce and our proofs out, Auth in: who the peer is, its proof (a failure is counted against
    the source address and the identity it claims, and answered late), its engine key's signature, then `peek`."""

    def __init__(self, hello: Hello, auth_token: str, limits: ServerLimits, guard: AdmissionGuard,
                 peek: PeekHook | None, prefill_key: bytes = b"") -> None:
        self.hello, self.auth_token, self.limits, self.guard, self.peek = hello, auth_token, limits, guard, peek
        self.prefill_key = prefill_key
        """The private half of our prefill key (b"": none), which signs each handshake's transcript."""
        self.identity = identity(hello)
        """What we tell peers about ourselves: least privilege, never our NIXL metadata or addresses."""
        if prefill_key:
            self.identity = msgspec.structs.replace(self.identity, engine_key=engine_public_key(prefill_key))

    async def run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, entry: Pending,
                  attempt: Attempt) -> tuple[Hello, Auth]:
        """Hello in, our Hello out, Auth in: who the peer is (its Auth's Hello) and its Auth, once its proof (if we
        need one) is right. What the peer said goes in `attempt` as soon as it is read (its opening, then its
        claim). `entry`: the connection in the guard's pending budget (told who the Auth claims to be)."""
        limit = self.limits.handshake_frame_bytes
        first = await read_frame(reader, limit)
        if isinstance(first, Reject):  # a probe (examples/proxy.py's start-up check) that only asks what listens
            raise Probed(f"first frame is Reject, expected Hello (a probe): the peer says {shown(first.reason, 200)}")
        if not isinstance(first, Hello):
            raise ControlError(f"first frame is {type(first).__name__}, expected Hello")
        attempt.first = first
        check_opening(first, self.hello)  # version, role (the model: decode compares, and says; who: in Auth)
        lane = (f"lane:{first.lane.hex()}", 0, 0)  # who it is, for the admission lanes (its Auth says more)
        locked = self.guard.claimed(entry, lane)
        if locked is not None:
            raise Unanswered(locked)
        ours = msgspec.structs.replace(self.identity, nonce=new_nonce())
        if self.auth_token:
            ours = msgspec.structs.replace(ours, proof=server_proof(self.auth_token, first, ours))
        if self.prefill_key:
            ours = msgspec.structs.replace(ours, signature=prefill_signature(self.prefill_key, first, ours))
        attempt.nonces = session_of(first, ours)
        writer.write(encode_frame(ours))
        await writer.drain()
        auth = await read_frame(reader, limit)
        if isinstance(auth, Reject):  # decode refused our Hello (our proof, most likely): say why it gave
            attempt.hint = auth.transfer_hint
            raise PeerGaveUp(f"a {first.role} rank refused this side's Hello: {shown(auth.reason, MAX_REASON_CHARS)}")
        if not isinstance(auth, Auth):
            raise ControlError(f"second frame is {type(auth).__name__}, expected Auth")
        claim = check_claim(first, auth.hello, f"{first.role} peer")
        attempt.first = claim
        check_hello(claim, self.hello)
        try:
            check_client_proof(self.auth_token, first, ours, auth)
        except ControlError as exc:
            self.guard.auth_failed(entry.host, lane)
            await asyncio.sleep(self.limits.auth_failure_delay_s)  # every guess costs the guesser this much
            raise AuthFailed(str(exc)) from None
        check_lane(self.auth_token, claim)
        check_engine_signature(first, ours, auth)
        if self.peek is not None:
            try:
                self.peek(claim)
            except Exception as exc:
                raise ControlError(f"refused: {exc}") from exc
        return claim, auth


async def end_session(session: Any) -> None:
    """Await `session.aclose()` if it has one (the engine's cleanup of a peer), logging rather than raising."""
    close = getattr(session, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except Exception:  # noqa: BLE001 - cleanup of one peer must not take the server down
        log.exception("ending the session of a side-channel peer failed")

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

from connector.core.errors import AuthFailed, ControlError, InputError, PeerGaveUp, Unanswered
from connector.core.untrusted import shown, shown_text
from connector.protocol.auth import (check_client_proof, check_engine_signature, check_prefill_key, check_server_proof,
                                     client_proof, engine_public_key, engine_signature, identity, memory_of, new_nonce,
                                     prefill_signature, server_proof, session_of)
from connector.protocol.handshake import check_hello
from connector.protocol.messages import (DEFAULT_MAX_FRAME_BYTES, HANDSHAKE_MAX_FRAME_BYTES, HEADER, Auth, Hello,
                                         Message, Reject, Welcome, check_header, decode_body, encode_frame)
from connector.transport.admission import AdmissionGuard, Pending
from connector.transport.limits import ServerLimits

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 500
"""Most characters of a peer's own refusal reason that are logged (it is the peer's text)."""


PeekHook = Callable[[Hello], None]
"""Called with a peer's first Hello before anything is answered (cheap checks only); raise to refuse it."""


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
    ours = msgspec.structs.replace(identity(hello), nonce=new_nonce(), for_transfer=for_transfer)
    if trusted_prefill_keys:  # our agent's name goes in the Auth's metadata, to a proven prefill only
        ours = msgspec.structs.replace(ours, agent_name="")
    writer.write(encode_frame(ours))
    await writer.drain()
    reply = _expect(await read_frame(reader, HANDSHAKE_MAX_FRAME_BYTES), Hello, where)
    try:
        check_hello(reply, hello)
        check_server_proof(auth_token, ours, reply)  # before a byte about our memory leaves
        check_prefill_key(trusted_prefill_keys, ours, reply)  # a token holder is not a prefill
        if check is not None:
            check(reply)  # so is the layout it claims (a fake prefill of 4096 ranks learns nothing of ours)
    except (ControlError, InputError) as exc:
        # Tell prefill why (else it sees only a closed connection), then give up.
        with contextlib.suppress(Exception):
            writer.write(encode_frame(Reject(str(exc))))
            async with asyncio.timeout(1.0):
                await writer.drain()
        raise ControlError(f"{where}: {exc}") from None
    auth = memory_of(hello)
    if hello.engine_key:
        auth = msgspec.structs.replace(auth, engine_signature=engine_signature(engine_key, ours, reply))
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
    """The peer's first Hello, once read (also one that `check_hello` then refuses: another model's)."""
    nonces: bytes = b""
    """The connection's two nonces (connector.protocol.auth.session_of), once our Hello is out."""


class ServerHandshake:
    """The server's half: Hello in (checked, then `peek`), our identity with a fresh nonce and our proof out, Auth in
    (its proof checked; a failure is counted against the source address and the identity it claims, and answered
    late)."""

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
        """Hello in, our Hello out, Auth in: the peer's Hello and Auth once its proof (if we need one) is right.
        The first Hello goes in `attempt` as soon as it is read (even one `check_hello` refuses: another model).
        `entry`: the connection in the guard's pending budget (told what the Hello claims)."""
        limit = self.limits.handshake_frame_bytes
        first = await read_frame(reader, limit)
        if not isinstance(first, Hello):
            raise ControlError(f"first frame is {type(first).__name__}, expected Hello")
        attempt.first = first
        check_hello(first, self.hello)
        claim = (first.engine_id, first.pp_rank, first.tp_rank)
        locked = self.guard.claimed(entry, claim)
        if locked is not None:
            raise Unanswered(locked)
        if self.peek is not None:
            try:
                self.peek(first)
            except Exception as exc:
                raise ControlError(f"refused: {exc}") from exc
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
            raise PeerGaveUp(f"{first.role} engine {first.engine_id} rank ({first.pp_rank},{first.tp_rank}) refused "
                             f"this side's Hello: {shown(auth.reason, MAX_REASON_CHARS)}")
        if not isinstance(auth, Auth):
            raise ControlError(f"second frame is {type(auth).__name__}, expected Auth")
        try:
            check_client_proof(self.auth_token, first, ours, auth)
        except ControlError as exc:
            self.guard.auth_failed(entry.host, claim)
            await asyncio.sleep(self.limits.auth_failure_delay_s)  # every guess costs the guesser this much
            raise AuthFailed(str(exc)) from None
        check_engine_signature(first, ours, auth)
        return first, auth


async def end_session(session: Any) -> None:
    """Await `session.aclose()` if it has one (the engine's cleanup of a peer), logging rather than raising."""
    close = getattr(session, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except Exception:  # noqa: BLE001 - cleanup of one peer must not take the server down
        log.exception("ending the session of a side-channel peer failed")

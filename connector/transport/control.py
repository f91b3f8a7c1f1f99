"""Asyncio TCP side channel between prefill and decode ranks.

What crosses the wire (messages, frames, the Hello checks, the proofs) is `connector.protocol`; the handshake's two
halves over a socket are `connector.transport.handshake`, the server's limits `connector.transport.limits`. This
module holds the server; a connection is `connector.transport.connection`, and a client opens one with
`connector.transport.client.connect`. Lifetimes: a `ControlServer` owns its connection tasks and closes them on
exit. Every wait on a peer has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import ssl
from typing import Any, Awaitable, Callable, Protocol

from connector.core.errors import AuthFailed, ControlError, FrameError, PeerGaveUp, Probed, Unanswered
from connector.core.untrusted import shown, shown_text
from connector.protocol.auth import key_fingerprint, with_memory
from connector.protocol.messages import Error, Hello, Message, Register, RegisterError, Reject, Welcome, encode_frame
from connector.transport.admission import AdmissionGuard, Pending
from connector.transport.connection import ControlConnection
from connector.transport.handshake import (Attempt, ServerHandshake, end_session, format_addr, is_loopback,
                                           read_frame)
from connector.transport.refusals import RefusalLog
from connector.transport.side_channel import SideChannelConfig
from connector.transport.tls import PausedUntilTLS

__all__ = ["ControlConnection", "ControlHandler", "ControlServer", "SideChannelConfig", "format_addr", "read_frame"]

log = logging.getLogger(__name__)

class ControlHandler(Protocol):
    """What a `ControlServer` asks of its owner (connector.engine.sender.StreamSender on prefill), one object rather
    than a callback per event, so the server's side of the conversation is named in one place."""

    def peek(self, hello: Hello) -> None:
        """Cheap checks of a peer's first Hello, before anything is answered; raise to refuse it."""

    def on_hello(self, peer: Hello) -> Any:
        """The peer's authenticated Hello (memory included); raise to refuse it. What it returns (or awaits to)
        becomes `conn.session`; if that has an `aclose()`, the server awaits it once the connection has ended; if
        its `evictable` is true, the connection may be closed for a newcomer's fair share
        (connector.transport.admission)."""

    def on_message(self, conn: ControlConnection, msg: Message) -> Awaitable[None]:
        """One message after the handshake, awaited in order; raising answers RegisterError or Error."""

    def on_closed(self, conn: ControlConnection) -> None:
        """A handshaken connection closed (once, from the loop): the one cleanup of everything that ran on it."""

    def on_refused(self, hello: Hello, reason: str, address: str, came_for: Callable[[str], bool]) -> None:
        """A handshake failed after the peer's first Hello (not authenticated: its opening, or who its Auth claimed
        to be) was read: the reason, the peer's address, and whether it connected for a transfer id
        (connector.transport.handshake.Attempt.came_for)."""

    def on_refusal(self, kind: str) -> None:
        """A connection was refused or failed, counted by `kind` (connector.transport.refusals): metrics."""


class ControlServer:
    """Accepts side-channel connections. Use as `async with ControlServer(...) as server:`; `server.port` is the
    bound port (useful with port=0).

    Everything configurable comes in `config` (connector.transport.side_channel). Per connection, from accept (TLS is
    started per connection, after admission, so a socket that never starts it is counted all the same): `config.limits`
    decide whether it may start (connections in all and per address), the pending budget it joins until it authenticated
    (connector.transport.admission: newcomers evict the oldest; known identities have their own lane), and its deadline:
    authenticated within `limits.handshake_deadline_s` of accept (or `handshake_timeout_s`, if shorter), TLS included.
    The handshake (connector.protocol.messages) reads frames of at most `limits.handshake_frame_bytes`: the peer's Hello
    is checked against `hello` (version, role, fingerprint) and by `handler.peek` (cheap checks), answered with our
    identity, a nonce and, with `auth_token`, our proof; its Auth must carry a valid proof. Then `handler.on_hello`
    gets the peer's Hello with its memory (raise to reject, the message is the reason), and the server answers Welcome
    and awaits `handler.on_message(conn, msg)` for each further message, in order. A handler exception is logged and
    answered with RegisterError (for Register) or Error; the connection stays up. `handler.on_closed(conn)` runs once
    per handshaken connection, soon after it closed (from the loop, never inside the code that closed it): the one
    cleanup of everything that ran on it, rather than a callback per use hooked on `conn.closed`.
    `handler.on_refused(hello, reason, address, came_for)` runs for each handshake that failed after the peer's first
    Hello was read (that Hello is not authenticated). Each refused or failed connection is counted by kind and logged
    at a bounded rate (`refusals`, connector.transport.refusals); `handler.on_refusal(kind)` is called for each (the
    engine's metrics)."""

    def __init__(self, hello: Hello, handler: ControlHandler, config: SideChannelConfig = SideChannelConfig(), *,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.hello = hello
        self.host = host
        self.port = port
        """The bound port once started."""
        self.handler, self._auth_token = handler, config.auth_token
        self._handshake_timeout_s = config.handshake_timeout_s
        self.limits = config.limits
        self.guard = AdmissionGuard(self.limits)
        self.refusals = RefusalLog(log, self.limits.refusal_log_interval_s, handler.on_refusal)
        """Refused and failed connections by kind, and how many lines they were logged in."""
        self._preauth_s = min(self.limits.handshake_deadline_s, self._handshake_timeout_s)
        self._hs = ServerHandshake(hello, config.auth_token, self.limits, self.guard, handler.peek,
                                   config.prefill_key)
        self._ssl = config.server_ssl()
        self._conn_kwargs = dict(max_frame_bytes=self.limits.max_frame_bytes,
                                 heartbeat_interval_s=config.heartbeat_interval_s, dead_after_s=config.dead_after_s,
                                 messages_per_s=self.limits.messages_per_s)
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self.connections: set[ControlConnection] = set()
        """Handshaken connections that are still open."""

    async def start(self) -> None:
        # Plain TCP: each connection starts TLS itself once admitted (asyncio's ssl= would call _handle only after
        # the TLS handshake, leaving connections that never start it uncounted, ~300 KB each).
        loop = asyncio.get_running_loop()
        protocol = PausedUntilTLS if self._ssl is not None else asyncio.StreamReaderProtocol

        def factory() -> asyncio.StreamReaderProtocol:  # what asyncio.start_server builds, with `protocol`
            return protocol(asyncio.StreamReader(limit=2**16, loop=loop), self._handle, loop=loop)

        self._server = await loop.create_server(factory, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        key = self._hs.identity.engine_key
        log.info("control server listening on %s:%d (%s, %s, %s)", self.host, self.port,
                 "auth token set" if self._auth_token else "no auth token", "TLS" if self._ssl else "no TLS",
                 f"prefill key {key_fingerprint(key)}" if key else "no prefill key")
        if not self._auth_token and not is_loopback(self.host):
            log.warning("the side channel listens on %s:%d, reachable from other hosts, WITHOUT an auth_token: any "
                        "host that reaches it can connect as a decode rank, register transfers and receive their KV. "
                        "Set the same auth_token on prefill and decode (and TLS: README, Security)", self.host,
                        self.port)
        elif self._auth_token and len(self._auth_token) < 16:
            log.warning("the side channel's auth_token has %d characters: a short token can be guessed offline "
                        "from one recorded handshake; use 32 random characters or more (openssl rand -hex 32)",
                        len(self._auth_token))

    async def aclose(self) -> None:
        """Stop accepting, close every connection, cancel and await the connection tasks."""
        if self._server is not None:
            self._server.close()
        self.refusals.close()
        for conn in list(self.connections):
            await conn.aclose("server shutting down")
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=5.0)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> "ControlServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        accepted_at = asyncio.get_running_loop().time()
        peername = writer.get_extra_info("peername")
        host = str(peername[0]) if isinstance(peername, tuple) else str(peername)
        refused = self.guard.admit(host, self._evictable)
        if refused is not None:
            self.refusals.note("limit", "refusing a connection from %s: %s", format_addr(peername), refused)
            writer.transport.abort()  # closed at once, nothing buffered for it
            return
        self._handlers.add(task)
        session = None
        entry = self.guard.begin(host, lambda why: task.cancel(why))  # its handshake gives up, see _handshake
        try:
            try:
                conn = await self._handshake(reader, writer, entry, accepted_at)
            finally:
                self.guard.done(entry)
            if conn is None:
                return
            session = conn.session
            self.connections.add(conn)
            try:
                await self._serve(conn)
            finally:
                self.connections.discard(conn)
                await conn.aclose()
        except asyncio.CancelledError:
            writer.close()
        except Exception:  # must never escape into asyncio's handler machinery
            log.exception("control connection from %s failed", format_addr(peername))
            writer.close()
        finally:
            self.guard.release(host)
            self._handlers.discard(task)
            await end_session(session)

    def _evictable(self, host: str) -> list[Callable[[str], None]]:
        """Closers of `host`'s authenticated connections whose session may go, least recently active first."""
        conns = sorted((c for c in self.connections if c.host == host and not c.is_closed
                        and getattr(c.session, "evictable", False)), key=lambda c: c.active_at)
        return [lambda why, c=c: (self.refusals.note("evicted", "closing %s: %s", c.address, why),
                                  c._shutdown(why, logging.WARNING)) for c in conns]

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, entry: Pending,
                         accepted_at: float) -> ControlConnection | None:
        addr = format_addr(writer.get_extra_info("peername"))
        reason, reply, session, peer, attempt, kind = None, None, None, None, Attempt(), "refused"
        try:
            # Until the proof checked out, the connection is anyone's: one deadline from accept, TLS included.
            async with asyncio.timeout_at(accepted_at + self._preauth_s):
                if self._ssl is not None:
                    await asyncio.sleep(0)  # arrivals of the same burst evict first (PausedUntilTLS)
                    await writer.start_tls(self._ssl)
                first, auth = await self._hs.run(reader, writer, entry, attempt)
            self.guard.authenticated(entry)
            peer = with_memory(first, auth)
            try:
                session = self.handler.on_hello(peer)
                if inspect.isawaitable(session):
                    session = await session
            except Exception as exc:
                raise ControlError(f"refused by on_hello: {exc}") from exc
            writer.write(encode_frame(Welcome()))
            try:
                async with asyncio.timeout(self._handshake_timeout_s):
                    await writer.drain()
            except TimeoutError:
                raise ConnectionError(f"our Welcome not sent within {self._handshake_timeout_s} s") from None
        except TimeoutError:
            kind = "deadline"
            reason = (f"no complete handshake within the {self._handshake_timeout_s:g} s handshake timeout"
                      if self._handshake_timeout_s <= self.limits.handshake_deadline_s else
                      f"not authenticated within {self.limits.handshake_deadline_s:g} s of accept (setting "
                      f"limits.handshake_deadline_s)")
        except asyncio.IncompleteReadError as exc:
            kind, reason = "closed", f"peer closed the connection during the handshake after {len(exc.partial)} bytes"
        except PeerGaveUp as exc:  # the peer already said why and left: nothing to answer
            reason = str(exc)
        except Unanswered as exc:
            kind, reason = "locked_out", str(exc)
        except Probed as exc:  # a router checking what listens here: answered, counted, logged at INFO
            kind, reason, reply = "probe", str(exc), Reject(str(exc))
        except ControlError as exc:  # FrameError included
            kind = "frame" if isinstance(exc, FrameError) else "auth" if isinstance(exc, AuthFailed) else "refused"
            reason, reply = str(exc), Reject(str(exc))
        except ssl.SSLError as exc:  # (an OSError) a peer that does not speak TLS, or a broken one
            kind, reason = "frame", f"TLS handshake failed: {exc!r} (decode needs tls_ca_file to speak TLS)"
        except (ConnectionError, OSError) as exc:
            kind, reason = "closed", f"connection lost during the handshake: {exc!r}"
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if entry.evicted is None or task is None or self._server is None or not self._server.is_serving():
                # the server is closing: what on_hello set up is undone all the same
                await asyncio.shield(end_session(session))
                raise
            task.uncancel()  # evicted from the pending budget (the guard cancelled us): a refusal like the others
            kind, reason = "evicted", f"evicted before it authenticated: {entry.evicted}"
        if reason is not None:
            reason = shown_text(reason)  # it may quote the peer (each quote is shown already): one line, bounded
            await end_session(session)
            self.refusals.note(kind, "closing %s: %s", addr, reason,
                               level=logging.INFO if kind == "probe" else logging.WARNING)
            if attempt.first is not None:
                try:
                    self.handler.on_refused(attempt.first, reason, addr, attempt.came_for)
                except Exception:  # noqa: BLE001 - the hook's failure must not keep the server from going on
                    log.exception("on_refused for %s failed", addr)
            if reply is not None:
                with contextlib.suppress(Exception):
                    writer.write(encode_frame(reply))
                    async with asyncio.timeout(1.0):
                        await writer.drain()
            if kind == "evicted":
                writer.transport.abort()  # its socket and buffers go now, not after a goodbye
            else:
                writer.close()
            return None
        log.info("control handshake with %s: %s engine %s pp%d/tp%d", addr, peer.role, shown(peer.engine_id),
                 peer.pp_rank, peer.tp_rank)
        conn = ControlConnection(reader, writer, peer, session=session, nonces=attempt.nonces, **self._conn_kwargs)
        conn.closed.add_done_callback(lambda _f: self.handler.on_closed(conn))
        return conn

    async def _serve(self, conn: ControlConnection) -> None:
        async for msg in conn:
            try:
                await self.handler.on_message(conn, msg)
            except Exception as exc:
                log.exception("handler for %s from %s failed", type(msg).__name__, conn.address)
                reason = f"{type(msg).__name__} handler failed: {exc!r}"
                answer: Message = (RegisterError(msg.transfer_id, reason) if isinstance(msg, Register)
                                   else Error(reason))
                try:
                    await conn.send(answer)
                except ControlError:
                    return


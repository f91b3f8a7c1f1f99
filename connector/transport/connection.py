"""One established, handshaken side-channel connection (either side): its reader, its heartbeat and its close.
Lifetimes: a `ControlConnection` owns its reader and heartbeat tasks and cancels them on `aclose()`. The server
that accepts connections is `connector.transport.control`; a client opens one with `connector.transport.client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Callable, Iterable

from connector.core.errors import ControlError, FrameError
from connector.protocol.messages import (DEFAULT_MAX_FRAME_BYTES, Auth, Error, Heartbeat, Hello, Message, Reject,
                                         Welcome, encode_frame)
from connector.transport.handshake import format_addr, read_frame
from connector.transport.limits import RateLimiter

log = logging.getLogger(__name__)

MAX_QUEUED = 1024
"""Messages read from a peer and not yet handled; beyond it the reader waits (TCP slows the peer down)."""


class _Closed:
    """Queue sentinel: the connection is closed."""


class ControlConnection:
    """One established, handshaken connection (either side). Create with `connect()` or get from `ControlServer`.

    Messages from the peer are read by an owned reader task into a queue; take them with `recv(timeout)` or
    `async for`. Empty Heartbeats only refresh liveness and are not queued. With `dead_after` set, a connection
    that receives nothing for that many seconds closes itself. With `heartbeat_interval` set, it sends
    `Heartbeat(heartbeat_ids())` at that interval (the peer's `dead_after` should be a few intervals)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Hello, *,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, send_timeout_s: float = 10.0,
                 heartbeat_interval_s: float | None = None, dead_after_s: float | None = None,
                 heartbeat_ids: Callable[[], Iterable[str]] | None = None,
                 on_close: Callable[[str], None] | None = None, messages_per_s: float | None = None,
                 session: Any = None, nonces: bytes = b"") -> None:
        self.peer = peer
        self.nonces = nonces
        """Both sides' handshake nonces: what binds a transfer's proof to this connection (protocol.auth)."""
        """The peer's Hello (on the server: completed with the memory its Auth carried)."""
        self.session = session
        """What the server's `on_hello` made of this peer (e.g. the engine's record of it); None on a client."""
        self.address = format_addr(writer.get_extra_info("peername"))
        """Peer `host:port`."""
        self.host, self.active_at = str((writer.get_extra_info("peername") or ("",))[0]), time.monotonic()
        """Peer host, and when it last sent something other than an empty Heartbeat."""
        self._reader, self._writer = reader, writer
        self._max_frame_bytes = max_frame_bytes
        self._send_timeout_s = send_timeout_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._dead_after_s = dead_after_s
        self._heartbeat_ids = heartbeat_ids or (lambda: ())
        self._on_close = on_close
        self._write_lock = asyncio.Lock()
        self._queue: asyncio.Queue[Message | _Closed] = asyncio.Queue()
        self._room = asyncio.Event()
        """Set while the queue has room for more messages (the reader waits for it)."""
        self._room.set()
        self._rate = RateLimiter(messages_per_s, f"peer {self.address}") if messages_per_s else None
        self.closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        """Resolves to the close reason once the connection is closed (never raises)."""
        self.close_reason: str | None = None
        self._tasks: list[asyncio.Task[None]] = [
            asyncio.create_task(self._read_loop(), name=f"control-read {self.address}")]
        if heartbeat_interval_s:
            self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name=f"control-heartbeat {self.address}"))

    @property
    def is_closed(self) -> bool:
        return self.close_reason is not None

    async def send(self, msg: Message) -> None:
        """Write one message. Writes are serialised; drain waits at most `send_timeout_s`, after which the
        connection is closed and ControlError raised."""
        if self.close_reason is not None:
            raise ControlError(f"connection to {self.address} is closed: {self.close_reason}")
        frame = encode_frame(msg)
        async with self._write_lock:
            try:
                self._writer.write(frame)
                async with asyncio.timeout(self._send_timeout_s):
                    await self._writer.drain()
            except TimeoutError:
                reason = f"send blocked for more than {self._send_timeout_s} s"
                self._shutdown(reason, logging.WARNING)
                raise ControlError(f"connection to {self.address}: {reason}") from None
            except (ConnectionError, RuntimeError) as exc:
                self._shutdown(f"send failed: {exc!r}", logging.WARNING)
                raise ControlError(f"connection to {self.address}: send failed: {exc!r}") from exc

    async def recv(self, timeout: float) -> Message:
        """Next message from the peer. Raises TimeoutError after `timeout` s, ControlError once closed."""
        async with asyncio.timeout(timeout):
            item = await self._queue.get()
        self._room.set()
        if isinstance(item, _Closed):
            self._queue.put_nowait(item)  # every later recv sees it too
            raise ControlError(f"connection to {self.address} is closed: {self.close_reason}")
        return item

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        while True:
            item = await self._queue.get()
            self._room.set()
            if isinstance(item, _Closed):
                self._queue.put_nowait(item)
                return
            yield item

    async def aclose(self, reason: str = "closed locally") -> None:
        """Close the socket and cancel owned tasks; idempotent. The first reason wins."""
        self._shutdown(reason, logging.DEBUG)
        current = asyncio.current_task()
        others = [t for t in self._tasks if t is not current and not t.done()]
        if others:
            await asyncio.wait(others, timeout=5.0)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await self._writer.wait_closed()

    async def __aenter__(self) -> "ControlConnection":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _shutdown(self, reason: str, level: int) -> None:
        """Synchronous part of closing: usable from inside the owned tasks."""
        if self.close_reason is not None:
            return
        self.close_reason = reason
        log.log(level, "closing %s: %s", self.address, reason)
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._writer.close()
        self._queue.put_nowait(_Closed())
        self.closed.set_result(reason)
        if self._on_close is not None:
            try:
                self._on_close(reason)
            except Exception:
                log.exception("on_close callback for %s failed", self.address)

    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    async with asyncio.timeout(self._dead_after_s):
                        msg = await read_frame(self._reader, self._max_frame_bytes)
                except TimeoutError:
                    self._shutdown(f"peer silent for more than {self._dead_after_s} s (dead_after)", logging.WARNING)
                    return
                if self._rate is not None:
                    await self._rate.take()
                match msg:
                    case Heartbeat(transfer_ids=[]):
                        continue  # liveness only: reading it was the point
                    case Hello() | Auth() | Welcome() | Reject():
                        await self._send_best_effort(Error(f"unexpected {type(msg).__name__} after the handshake"))
                        self._shutdown(f"protocol violation: {type(msg).__name__} after the handshake", logging.WARNING)
                        return
                    case _:
                        self.active_at = time.monotonic()
                        self._queue.put_nowait(msg)
                        if self._queue.qsize() >= MAX_QUEUED:
                            self._room.clear()
                            await self._room.wait()
        except asyncio.IncompleteReadError:
            self._shutdown("peer closed the connection", logging.INFO)
        except FrameError as exc:
            await self._send_best_effort(Error(str(exc)))
            self._shutdown(str(exc), logging.WARNING)
        except (ConnectionError, OSError) as exc:
            self._shutdown(f"connection lost: {exc!r}", logging.WARNING)
        except asyncio.CancelledError:
            self._shutdown("closed locally", logging.DEBUG)
            raise
        except Exception as exc:  # a bug here must not vanish
            log.exception("reader for %s failed", self.address)
            self._shutdown(f"reader failed: {exc!r}", logging.ERROR)

    async def _heartbeat_loop(self) -> None:
        assert self._heartbeat_interval_s
        try:
            while True:
                await asyncio.sleep(self._heartbeat_interval_s)
                await self.send(Heartbeat(transfer_ids=list(self._heartbeat_ids())))
        except ControlError:
            return  # send() already closed the connection and logged why
        except Exception as exc:
            log.exception("heartbeat for %s failed", self.address)
            self._shutdown(f"heartbeat failed: {exc!r}", logging.ERROR)

    async def _send_best_effort(self, msg: Message) -> None:
        with contextlib.suppress(Exception):
            self._writer.write(encode_frame(msg))
            async with asyncio.timeout(1.0):
                await self._writer.drain()

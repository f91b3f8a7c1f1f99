"""The client's side of the side channel: open a connection to a prefill rank and run the handshake.

The connection it returns is connector.transport.connection's `ControlConnection`, the same class the server hands
its handlers."""

from __future__ import annotations

import asyncio
import ssl
from typing import Callable, Iterable

from connector.core.errors import ControlError, Unreachable
from connector.protocol.messages import Hello
from connector.transport.connection import ControlConnection
from connector.transport.handshake import client_handshake
from connector.transport.side_channel import SideChannelConfig

__all__ = ["connect"]


async def connect(host: str, port: int, hello: Hello, config: SideChannelConfig = SideChannelConfig(), *,
                  timeout: float | None = None, heartbeat_ids: Callable[[], Iterable[str]] | None = None,
                  on_close: Callable[[str], None] | None = None, for_transfer: str = "",
                  check: Callable[[Hello], None] | None = None, engine_key: bytes = b"") -> ControlConnection:
    """Open a connection (over TLS with `config.tls_ca_file`) and run the handshake (connector.protocol.messages) in
    at most `timeout` s (default `config.handshake_timeout_s`): send who we are, check the server's Hello (version,
    role, fingerprint, and with `config.auth_token` its proof), and only then send `hello`'s memory (NIXL metadata,
    regions, staging buffer) with our proof, and wait for Welcome. The connection then sends `heartbeat_ids()`
    every `config.heartbeat_interval_s` and closes itself after `config.dead_after_s` of silence. `for_transfer`:
    the transfer this connection is opened for (a server that refuses the handshake frees its KV at once); `check`:
    refuses the server's Hello (raise) before our memory leaves, as the server's own checks do; `engine_key`: the
    private key of `hello.engine_key`, which signs the handshake (connector.protocol.auth).
    Raises ControlError if the peer rejects us (with its reason), fails a check, or answers with something else."""
    where, ssl_context = f"{host}:{port}", config.client_ssl()
    timeout = timeout or config.handshake_timeout_s
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port, ssl=ssl_context,
                                                           server_hostname=host if ssl_context else None)
    except ssl.SSLError as exc:  # (an OSError) reached, but the TLS handshake failed
        raise ControlError(f"TLS handshake with {where} failed: {exc!r} (tls_ca_file on decode must hold the CA "
                           f"of prefill's tls_cert_file, issued for this host)") from exc
    except (OSError, TimeoutError) as exc:
        raise Unreachable(f"cannot connect to {where}: {exc!r}") from exc
    try:
        async with asyncio.timeout(timeout):
            reply, nonces = await client_handshake(reader, writer, hello, config.auth_token, where, for_transfer,
                                                   check, engine_key, config.trusted_keys)
    except BaseException as exc:
        writer.close()
        if isinstance(exc, TimeoutError):
            raise ControlError(f"handshake with {where} timed out after {timeout} s") from None
        if isinstance(exc, asyncio.IncompleteReadError):
            raise ControlError(f"{where} closed the connection during the handshake") from None
        if isinstance(exc, (ConnectionError, OSError)) and not isinstance(exc, ControlError):
            raise ControlError(f"handshake with {where} failed: {exc!r}") from exc
        raise
    return ControlConnection(reader, writer, reply, max_frame_bytes=config.limits.max_frame_bytes,
                             heartbeat_interval_s=config.heartbeat_interval_s, dead_after_s=config.dead_after_s,
                             heartbeat_ids=heartbeat_ids, on_close=on_close, nonces=nonces)

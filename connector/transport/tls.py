"""Optional TLS for the side channel (the standard library's `ssl`): prefill serves with a certificate and key,
decode verifies it against a CA bundle (and the host name or IP address it connects to). With TLS the messages after
the handshake (block ids, transfer ids, decode's NIXL metadata) are private and cannot be rewritten in flight; the
auth token (connector.protocol.auth) still decides who may connect."""

from __future__ import annotations

import asyncio
import functools
import ssl

from connector.core.errors import ConfigError


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext | None:
    """Prefill's context (TLS 1.2 or newer), or None when no certificate is configured."""
    if not cert_file and not key_file:
        return None
    if not cert_file or not key_file:
        raise ConfigError("TLS on the side channel needs both tls_cert_file and tls_key_file (PEM); got only "
                          f"{'tls_cert_file' if cert_file else 'tls_key_file'}")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the side channel's TLS certificate {cert_file!r} / key {key_file!r}: {exc}; "
                          f"give PEM files this process can read") from None
    return ctx


@functools.lru_cache(maxsize=8)
def client_context(ca_file: str) -> ssl.SSLContext | None:
    """Decode's context, verifying prefill's certificate against `ca_file`, or None when TLS is off. Built once per
    bundle: every connection of the process shares it (a context is reusable, loading the bundle is not free)."""
    if not ca_file:
        return None
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the side channel's TLS CA bundle {ca_file!r}: {exc}; give a PEM file this "
                          f"process can read") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


class PausedUntilTLS(asyncio.StreamReaderProtocol):
    """A TLS server's connection (connector.transport.control serves plain TCP and starts TLS per connection, once
    admitted, so that every socket is counted from accept) reads nothing until its handler starts TLS: bytes read
    before `start_tls` would be lost to it, and the handler first yields once, so that a burst of arrivals evicts
    its own (connector.transport.admission) before any of them allocates TLS state (~300 KB each)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport.pause_reading()  # type: ignore[attr-defined]  # start_tls resumes it

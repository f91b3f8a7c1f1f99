"""The side channel's settings: one object, defaults once, handed whole to both ends of connector.transport.control
(`ControlServer` on prefill, `connect` on decode). A new side-channel setting is a field here and its use in
control.py; nothing between the operator's settings and the socket unpacks it."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from connector.transport.limits import ServerLimits
from connector.transport.tls import client_context, server_context


@dataclass(frozen=True)
class SideChannelConfig:
    """The TCP side channel between a prefill and a decode rank (connector.transport.control)."""

    auth_token: str = ""
    """Shared secret both sides prove they hold in the handshake (challenge-response, never sent:
    connector.protocol.auth); empty = no authentication (a warning is logged when prefill then listens on an address
    other hosts can reach)."""
    handshake_timeout_s: float = 10.0
    """Connecting and the whole handshake, each way."""
    heartbeat_interval_s: float | None = 2.0
    """How often each end sends a heartbeat (None: never; only tests of the bare channel turn it off)."""
    dead_after_s: float | None = 15.0
    """A peer silent for this long is treated as dead (a few heartbeat intervals; None: never)."""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    """Prefill: PEM certificate and key; set both to serve the side channel over TLS (connector.transport.tls)."""
    tls_ca_file: str = ""
    """Decode: PEM CA bundle; set it to connect over TLS and verify prefill's certificate and host."""
    limits: ServerLimits = field(default_factory=ServerLimits)
    """Prefill: connections, frame sizes, message rate and failed authentications (connector.transport.limits)."""
    prefill_key: bytes = b""
    """Prefill: the private half of its prefill key (an Ed25519 key's 32 bytes; b"": none), which signs every
    handshake (connector.protocol.auth, prefill keys)."""
    trusted_keys: frozenset[bytes] = frozenset()
    """Decode: the public prefill keys it trusts; if any, it sends its memory (NIXL metadata and regions, with which
    a peer can WRITE anywhere decode registered) only to a prefill that proves one of them."""
    max_peer_ranks: int = 256
    """The most ranks (tp_size x pp_size) a peer engine may claim; a larger claim is refused before any plan is
    built (a plan's cost grows with the peer's ranks)."""

    def server_ssl(self) -> ssl.SSLContext | None:
        """Prefill's TLS context, or None without a certificate (raises ConfigError for unreadable files)."""
        return server_context(self.tls_cert_file, self.tls_key_file)

    def client_ssl(self) -> ssl.SSLContext | None:
        """Decode's TLS context, or None without a CA bundle (raises ConfigError for an unreadable file)."""
        return client_context(self.tls_ca_file)

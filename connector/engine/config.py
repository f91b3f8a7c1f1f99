"""Settings of the two engines and their defaults, in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SenderConfig:
    host: str = "127.0.0.1"
    port: int = 0
    auth_token: str = ""
    lease_s: float = 120.0
    """How long a finished request keeps its blocks for decode ranks that have not completed; heartbeats extend."""
    write_timeout_s: float = 60.0
    handshake_timeout_s: float = 10.0
    heartbeat_interval_s: float = 2.0
    dead_after_s: float = 10.0
    max_writes_per_destination: int = 2
    poll_interval_s: float = 0.0005
    """While requests are active, how often the loop picks up hook calls (see `layer_ready`)."""
    released_memory_s: float = 600.0
    """How long a finished transfer id is remembered, so a late registration for it is refused clearly."""


@dataclass(frozen=True)
class ReceiverConfig:
    auth_token: str = ""
    connect_timeout_s: float = 10.0
    transfer_timeout_s: float = 120.0
    heartbeat_interval_s: float = 2.0
    dead_after_s: float = 10.0
    stop_timeout_s: float = 60.0
    """After an abort or failure, how long to wait for every prefill rank to confirm it writes nothing more."""
    staging_slot_bytes: int = 64 * 1024 * 1024
    """With a staging buffer: the slot each prefill rank connection gets (a staged chunk is at most this)."""

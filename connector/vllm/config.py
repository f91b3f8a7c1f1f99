"""`kv_connector_extra_config` -> typed settings. Unknown keys are a startup error listing the valid ones."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ConnectorSettings:
    side_channel_host: str | None = None
    """Address prefill ranks listen on for decode's side channel. Default: the host vLLM reports for this node
    (VLLM_HOST_IP / its own IP detection), never 0.0.0.0 unless set explicitly."""
    side_channel_port: int = 5600
    """Port of prefill rank (pp0, tp0); rank (pp, tp) listens on this + pp * tp_size + tp."""
    auth_token: str = ""
    """Shared secret both sides present in the handshake; empty = no authentication."""
    lease_s: float = 120.0
    """How long prefill keeps a finished request's blocks for decode ranks that have not completed (heartbeats
    from decode extend it)."""
    max_inflight_bytes: int = 1 << 30
    """Backpressure: bytes posted to NIXL but not completed, per worker."""
    posts_per_second: float | None = None
    """Optional cap on NIXL WRITE posts per second per worker."""
    handshake_timeout_s: float = 10.0
    transfer_timeout_s: float = 300.0
    """Decode gives up on a transfer after this long (then kv_load_failure_policy applies)."""
    write_timeout_s: float = 60.0
    heartbeat_interval_s: float = 2.0
    dead_after_s: float = 15.0
    """A side-channel peer silent for this long is treated as dead."""
    progress_delay_us: int = 1000
    """NIXL progress-thread poll delay (never 0: 0 spins a core)."""
    staging_mb: int = 0
    """Per-worker staging buffer on the KV-cache device, in MiB (0 = off). When prefill and decode both have one,
    scattered blocks move as gathered chunks, one NIXL descriptor each, and decode scatters them (connector.engine.staging):
    far fewer descriptors when vLLM's blocks are fragmented."""
    staging_slot_mb: int = 16
    """Decode: the part of its staging buffer each prefill rank connection may use (one chunk in flight each)."""

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        valid = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(valid))
        if unknown:
            raise ValueError(f"SparseKVConnector: unknown kv_connector_extra_config key(s) {unknown}; valid keys are "
                             f"{sorted(valid)}")
        out: dict[str, Any] = {}
        for key, value in extra.items():
            default = valid[key].default
            kind = type(default) if default is not None else (float if key == "posts_per_second" else str)
            try:
                out[key] = None if value is None else (kind(value) if not isinstance(value, bool) else value)
            except (TypeError, ValueError):
                raise ValueError(f"SparseKVConnector: kv_connector_extra_config[{key!r}]={value!r} is not a "
                                 f"{kind.__name__}") from None
        settings = dataclasses.replace(cls(), **out)
        for key in ("lease_s", "handshake_timeout_s", "transfer_timeout_s", "write_timeout_s",
                    "heartbeat_interval_s", "dead_after_s", "max_inflight_bytes", "progress_delay_us"):
            if getattr(settings, key) <= 0:
                raise ValueError(f"SparseKVConnector: kv_connector_extra_config[{key!r}] must be > 0")
        if settings.staging_mb < 0 or settings.staging_slot_mb <= 0:
            raise ValueError(f"SparseKVConnector: staging_mb ({settings.staging_mb}) must be >= 0 and "
                             f"staging_slot_mb ({settings.staging_slot_mb}) > 0")
        if not 0 < settings.side_channel_port < 65536:
            raise ValueError(f"SparseKVConnector: side_channel_port {settings.side_channel_port} is not a port")
        return settings

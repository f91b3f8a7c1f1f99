"""Settings of the two engines and their defaults, in one place. The side channel is the same on both sides: its
settings are one object (`SideChannelConfig`, defined where the side channel is: connector.transport.side_channel)
that both configs hold and hand on whole. `connector.vllm.config.ConnectorSettings` (the operator's
`kv_connector_extra_config`) takes its defaults from here and builds these objects."""

from __future__ import annotations

from dataclasses import dataclass, field

from connector.transport.side_channel import SideChannelConfig

__all__ = ["ReceiverConfig", "SenderConfig", "SideChannelConfig", "default_staging_mb", "lost_source_hold_s"]


STAGING_MB_CUDA = 256
"""Default staging buffer per worker when the KV cache is in GPU memory: staged chunks are the fast path there (one
NIXL descriptor per chunk instead of one per block range; see docs/performance.md)."""
STAGING_MB_CPU = 0
"""Default when the KV cache is in host memory: off. There the gather and the scatter are CPU copies (three copies of
every byte instead of the one a direct WRITE makes), so staging trades descriptors for CPU time that prefill's own
compute needs. Measured on a 2-core box (docs/performance.md): bulk transfers move at about the same rate
either way (within the noise of a shared machine), but streaming during compute with staging made the simulated
compute about 1.6x slower and the exposed time longer. `staging_mb` still turns it on for CPU memory."""


def default_staging_mb(cuda: bool) -> int:
    """The staging buffer a worker gets unless configured (`staging_mb`; 0 turns staging off)."""
    return STAGING_MB_CUDA if cuda else STAGING_MB_CPU


@dataclass(frozen=True)
class SenderConfig:
    """A prefill rank."""

    host: str = "127.0.0.1"
    """Address the side channel listens on."""
    port: int = 0
    """Port the side channel listens on (0: any free one; see connector.protocol.addressing for the rule)."""
    side_channel: SideChannelConfig = field(default_factory=SideChannelConfig)
    lease_s: float = 120.0
    """How long a finished request keeps its blocks for decode ranks that have not completed; heartbeats extend."""
    write_timeout_s: float = 60.0
    """One WRITE (or staged chunk), from admission to completion."""
    max_writes_per_destination: int = 2
    layer_wake_gap_us: int = 2000
    """Prefill: a computed layer wakes the sender's loop only if no layer did in the last this many microseconds; the
    layers in between go out with the next wake, as one WRITE per decode rank, at the latest at the end of their
    forward step. Bounds the loop's wakes (and the Python each costs under the forward's GIL) to about 500 a second
    however short the layers are (docs/performance.md). The floor of the gap: `layer_wake_cpu_share` raises it where
    a wake costs more. 0: every layer wakes (and no pacing)."""
    layer_wake_cpu_share: float = 0.02
    """Prefill: the share of a core the sender's loop may spend on layer wakes while layers stream. The loop
    measures its CPU per wake and widens the gap between layer wakes (from `layer_wake_gap_us` up to
    `layer_wake_gap_max_us`) until a wake's cost is at most this share of the time to the next one: the forward
    pays for that CPU where it shares the core or the GIL. 0: the gap stays at `layer_wake_gap_us`."""
    layer_wake_gap_max_us: int = 20_000
    """Prefill: the widest gap between layer wakes that `layer_wake_cpu_share` may set. Layers computed within the
    last gap go out at the end of their step at the latest, so this bounds what streaming leaves for after it. 20 ms:
    on the M3 bench (8 ms layers) 30 and 50 ms stretched the forward to 1.03-1.06x, as several layers' copy at once
    overlapped the next layers, against 1.019x at 20 ms; a CPU engine whose prefill owns one core gains from more
    (docs/performance.md)."""
    released_memory_s: float = 600.0
    """How long a finished transfer id is remembered, so a late registration for it is refused clearly."""
    given_up_keep_s: float = 2.0
    """A request a decode engine aborted before registering keeps its KV this long after it finished (instead of
    the lease), in case another engine registers it (so an unrelated peer's abort cannot deny a transfer)."""
    max_parked_per_connection: int = 4096
    """Registrations one decode connection may have waiting for prefill to start their request."""
    max_parked_bytes_per_connection: int = 16 * 1024 * 1024
    """Memory those waiting registrations may hold, per decode connection (their block ids, kept as arrays)."""
    max_parked: int = 16384
    """Registrations waiting for prefill to start their request, over all decode connections together."""
    max_parked_bytes: int = 64 * 1024 * 1024
    """Memory those waiting registrations may hold over all decode connections together (4 bytes per block id, plus
    a few hundred per registration: a 128k-token request of 3 groups of 16-token blocks holds about 96 KiB, so 64 MiB
    hold about 680 such requests queued on prefill, far more shorter ones)."""
    max_peer_agents: int = 512
    """Decode NIXL agents loaded at once, those of live connections and idle ones kept for a reconnect
    (connector.engine.agents); a handshake that would need more is refused."""
    max_agents_per_host: int = 64
    """Decode NIXL agents loaded at once for connections from one source address (a decode node holds one per
    rank and engine that prefill rank feeds); a new one beyond it replaces an idle one of that address, else it is
    refused (connector.engine.agents). So one address cannot take the room of decodes that come later."""
    agent_unloads_per_hour: int = 64
    """Idle decode agents unloaded to make room for new ones from one source address, at most this many in any
    hour: NIXL 1.5.1 leaves `nixl_threads` sockets open on each unload while the decode process lives, so this
    bounds how fast an address can grow prefill's open files (connector.engine.agents); beyond it that address's
    new agent is refused, and no other address's."""
    staging_ring_slots: int = 4
    """Staged chunks in flight per decode connection: decode's staging area for the connection is cut into this many
    slots, so the gather of one chunk, the WRITE of the next and decode's scatter of a third overlap."""
    stage_min_descriptors: int = 8
    """A batch with fewer descriptors is written directly (a gather and a scatter cost more than they save)."""
    stage_below_bytes: int | None = None
    """A batch is staged when its descriptors average fewer bytes than this (scattered blocks); longer runs are
    written directly. None: 4 MiB on VRAM (NIXL's per-descriptor cost dwarfs a device copy) and 64 KiB on DRAM
    (where the copies themselves cost about as much as the descriptors they save; docs/performance.md, the bench)."""
    record_timeline: bool = False
    """Keep each batch's post, write and landing times per transfer (the bench's timeline plot)."""
    log_timeline: bool = False
    """Log each transfer's timeline (connector.engine.timeline) at INFO instead of DEBUG."""


@dataclass(frozen=True)
class ReceiverConfig:
    """A decode rank."""

    side_channel: SideChannelConfig = field(default_factory=SideChannelConfig)
    transfer_timeout_s: float = 300.0
    """A transfer with no completion from every source by then fails (vLLM's kv_load_failure_policy applies)."""
    stop_timeout_s: float = 60.0
    """After an abort or failure, how long to wait for every prefill rank to confirm it writes nothing more."""
    lost_source_hold_s: float = 13.0
    """A prefill rank whose side channel was lost before it confirmed it writes nothing more: how long decode keeps
    asking it (over new connections) before its blocks are handed back anyway. Must exceed prefill's
    tcp_user_timeout_s plus one heartbeat interval: by then UCX has ended any WRITE stuck on a dead link (the
    default is 10 + 2 + 1 s)."""
    log_timeline: bool = False
    """Log each transfer's timeline (connector.engine.timeline) at INFO instead of DEBUG."""
    kv_checksum: bool = False
    """Verify every transfer end to end: prefill digests what it sent per (pool, layer, block), decode digests what
    its blocks hold once every source completed, and a difference fails the transfer naming the blocks
    (connector.core.checksums). Costs one read of the transfer's bytes on each side (a reduction kernel on a GPU)."""
    staging_slot_bytes: int = 64 * 1024 * 1024
    """With a staging buffer: the most of it one prefill rank connection gets as its staging area (prefill cuts it
    into a ring of `SenderConfig.staging_ring_slots` chunks). A prefill engine with more ranks than the buffer holds
    such areas for gets equal shares of the buffer."""


def lost_source_hold_s(tcp_user_timeout_s: float | None, heartbeat_interval_s: float) -> float:
    """`ReceiverConfig.lost_source_hold_s` for a prefill whose transport uses `tcp_user_timeout_s`: a WRITE stuck on
    a dead link has ended by then. Without a user timeout the kernel decides (`net.ipv4.tcp_retries2`): 120 s."""
    return (tcp_user_timeout_s if tcp_user_timeout_s is not None else 120.0) + heartbeat_interval_s + 1.0

"""What one simulated rank is, as plain data: it crosses the process boundary to the rank's worker (pickled), so it
imports nothing heavy."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Literal

from connector.core.layout import ModelLayout, ParallelLayout
from connector.core.plan import Rank
from connector.engine.config import SenderConfig, SideChannelConfig
from connector.protocol.addressing import side_channel_port
from connector.transport.nixl.settings import TransportConfig  # (no numpy; NIXL itself loads with the first agent)

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Placement:
    """Where one side's rank processes run: one machine's loopback by default, or a "node" of their own (a network
    namespace, sparse_kv_lab.sim.netns) with UCX told to use its interface over TCP."""

    host: str = LOOPBACK
    """The side's address. Prefill ranks listen on it for decode's side channel; decode connects to it."""
    netns: str | None = None
    """Network namespace the rank processes enter before NIXL loads (None: the parent's)."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment the rank processes set before NIXL loads, over sparse_kv_lab.sim.env's defaults. Across namespaces:
    UCX_NET_DEVICES=<the node's interface> and UCX_TLS=tcp (UCX otherwise moves the bytes through shared memory)."""

    @classmethod
    def node(cls, host: str, netns: str, device: str) -> "Placement":
        """A side on its own node: `netns`, with UCX over TCP on `device` (an interface inside it)."""
        return cls(host, netns, (("UCX_NET_DEVICES", device), ("UCX_TLS", "tcp")))


@dataclass(frozen=True)
class RankSpec:
    """Everything one simulated rank needs; pickled to its worker process."""

    side: Literal["prefill", "decode"]
    rank: Rank
    """(pp, tp) on its side."""
    model: ModelLayout
    prefill: ParallelLayout
    decode: ParallelLayout
    block_size: int
    num_blocks: int
    """Blocks per pool in the simulated cache."""
    device: str = "cpu"
    run_blocks: int = 1
    """Block ids are picked in runs of this many consecutive ids (1 = scattered, as a busy vLLM hands them out)."""
    staging_mb: int = 0
    base_port: int = 0
    """Side-channel port of prefill rank (0, 0); 0 = any free port (an in-process rank in a test)."""
    run_id: str = "sim"
    timeout_s: float = 120.0
    log_level: int = logging.WARNING
    placement: Placement = Placement()
    """Where this rank runs (its side's placement)."""
    side_channel: SideChannelConfig = SideChannelConfig()
    tcp_user_timeout_s: float | None = TransportConfig.__dataclass_fields__["tcp_user_timeout_s"].default
    """connector.transport.nixl.TransportConfig.tcp_user_timeout_s."""
    nixl_threads: int = TransportConfig.__dataclass_fields__["nixl_threads"].default
    """connector.transport.nixl.TransportConfig.nixl_threads."""
    write_timeout_s: float | None = None
    """SenderConfig.write_timeout_s; None: timeout_s."""
    auth_token: str = ""
    """The side channel's shared secret (both sides of a run get the same)."""
    sender_config: SenderConfig | None = None
    """A prefill rank's engine settings (its host and port are this spec's); None = the defaults."""
    kv_checksum: bool = False
    """A decode rank verifies every transfer end to end (ReceiverConfig.kv_checksum)."""

    @property
    def side_channel_config(self) -> SideChannelConfig:
        """`side_channel` with this run's auth_token, when one is set."""
        if not self.auth_token:
            return self.side_channel
        return dataclasses.replace(self.side_channel, auth_token=self.auth_token)

    @property
    def parallel(self) -> ParallelLayout:
        return self.prefill if self.side == "prefill" else self.decode

    @property
    def engine_id(self) -> str:
        return f"{self.side}-{self.run_id}"

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.device.startswith("cuda") else "DRAM"

    @property
    def port(self) -> int:
        """Side-channel port of this (prefill) rank."""
        return side_channel_port(self.base_port, self.rank, self.prefill.tp) if self.base_port else 0

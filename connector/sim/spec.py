"""What one simulated rank is, as plain data: it crosses the process boundary to the rank's worker (pickled), so it
imports nothing heavy."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from connector.core.layout import ModelLayout, ParallelLayout
from connector.core.plan import Rank
from connector.engine.config import SenderConfig
from connector.protocol.addressing import side_channel_port


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
    auth_token: str = ""
    """The side channel's shared secret (both sides of a run get the same)."""
    sender_config: SenderConfig | None = None
    """A prefill rank's engine settings (its port is this spec's); None = the defaults."""

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

"""This rank, as both engines and their peers see it: one description of "who am I" (engine, layout, rank, the
memory it holds, its staging buffer) from which the Hello, the device id and the memory type all follow."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from connector.core.block_views import pool_block_sizes
from connector.core.descriptors import NO_NULL_BLOCK
from connector.core.errors import ConfigError
from connector.core.layout import ModelLayout, ParallelLayout, Region, full_block_size
from connector.core.plan import Rank
from connector.protocol.handshake import layout_wire
from connector.protocol.messages import Hello, Role
from connector.transport.base import KVTransport


@dataclass(frozen=True)
class LocalRank:
    engine_id: str
    """vLLM's engine id (or the demo's run id): peers tell ranks of different engines apart by it."""
    model: ModelLayout
    parallel: ParallelLayout
    """This side's TP size and PP stages."""
    rank: Rank
    """(pp, tp) of this rank."""
    regions: tuple[Region, ...]
    """Every (pool, global layer) this rank holds, with addresses (what peers WRITE into or read from)."""
    block_size: int
    """Tokens per KV-cache block; where caches have several block sizes, the gcd of the paged ones: the unit
    block spans count in (connector.core.descriptors.group_range)."""
    mem_type: str = "DRAM"
    """NIXL memory type of the KV caches and the staging buffer: "DRAM" (CPU) or "VRAM" (GPU)."""
    staging: Any = None
    """Optional contiguous uint8 tensor on the KV device, registered with the transport. When both sides have one,
    scattered blocks move as staged chunks (connector.engine.staging)."""
    null_block: int = NO_NULL_BLOCK
    """The block id that holds nothing (vLLM's null block 0, connector.core.descriptors.NULL_BLOCK); -1: none.
    Decode's is not written, prefill's is never read (a sliding window left those positions behind)."""

    def __post_init__(self) -> None:
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ConfigError(f"mem_type {self.mem_type!r} is not a NIXL memory type: use 'DRAM' or 'VRAM'")

    @cached_property
    def by_key(self) -> dict[tuple[str, int], Region]:
        """Regions by (pool, global layer)."""
        return {r.key: r for r in self.regions}

    @cached_property
    def full_block_size(self) -> int:
        """Tokens after which every paged cache of this rank ends a block: the lcm of its regions' block sizes
        (`block_size`, the unit spans count in, divides it). What checksums cover whole."""
        return max(self.block_size, full_block_size(
            r.block_size for r in self.regions if not r.per_request and r.block_size))

    @property
    def stage(self) -> tuple[int, int]:
        """[start, end) global layers of this rank's PP stage."""
        return self.parallel.stages[self.rank[0]]

    @property
    def device_id(self) -> int:
        """Device index of the KV caches (0 on CPU)."""
        return self.regions[0].device_id if self.regions else 0

    @property
    def staging_addr(self) -> int:
        return self.staging.data_ptr() if self.staging is not None else 0

    @property
    def staging_bytes(self) -> int:
        return self.staging.numel() * self.staging.element_size() if self.staging is not None else 0

    @property
    def staging_device(self) -> int:
        return (self.staging.device.index or 0) if self.staging is not None else 0

    def hello(self, role: Role, transport: KVTransport) -> Hello:
        """This rank's Hello, memory included; `transport` (a connector.transport.nixl.Transport) gives the NIXL
        agent's name and metadata, so build it after every region is registered. (The handshake sends the memory
        only where the protocol needs it: connector.protocol.auth.)"""
        return Hello(role=role, engine_id=self.engine_id, pp_rank=self.rank[0], tp_rank=self.rank[1],
                     pp_size=self.parallel.pp, tp_size=self.parallel.tp, fingerprint=self.model.fingerprint(),
                     layout=layout_wire(self.model), num_layers=self.model.num_layers,
                     block_size=self.block_size, agent_name=transport.name, agent_metadata=transport.metadata,
                     regions=list(self.regions), stages=[tuple(s) for s in self.parallel.stages],
                     staging_addr=self.staging_addr, staging_device=self.staging_device,
                     staging_bytes=self.staging_bytes, null_block=self.null_block,
                     pool_block_sizes=sorted(pool_block_sizes(self.regions, self.block_size).items()))

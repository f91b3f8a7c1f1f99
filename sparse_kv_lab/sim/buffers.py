"""Simulated KV caches for the demo, the bench and the transfer tests: per-rank buffers laid out like a paged
cache, deterministic content per (pool, global layer, token, head, element), and byte-exact verification.

Buffer of one pool on one rank: uint8 [local layers, parts, num_blocks, local heads, block_size, bytes_per_elem_row],
i.e. one tensor per layer (like vLLM), K/V halves as parts, head-major blocks (HND) so a head slice is contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from connector.core.layout import POOLS, ModelLayout, ParallelLayout, RankLayout, Region, blocks_for

POOL_GROUP = {"kv": 0, "index_k": 1, "index_v": 1}
"""KV-cache group per pool: like vLLM, the main cache and the index caches get separate block tables."""
NUM_GROUPS = 2


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32), elementwise on int64 tensors."""
    m = 0xFFFFFFFF
    x = x & m
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & m
    x = ((x ^ (x >> 15)) * 0x846CA68B) & m
    return x ^ (x >> 16)


def content(pool: str, layer: int, tokens: torch.Tensor, heads: tuple[int, int], parts: int, row_bytes: int,
            device: torch.device) -> torch.Tensor:
    """Expected bytes, uint8 [len(tokens), parts, heads, row_bytes], of (pool, global layer, token, global head,
    element). Row = pattern[part, head, :] * a[token] + b[token] (mod 256), a odd: two tokens share a row with
    probability 2**-15, and a whole block of them practically never, so a misplaced block is always caught."""
    pool_id = POOLS.index(pool) + 1
    part_ids = torch.arange(parts, device=device, dtype=torch.int64)
    head_ids = torch.arange(*heads, device=device, dtype=torch.int64)
    elems = torch.arange(row_bytes, device=device, dtype=torch.int64)
    seed = pool_id * 1_000_003 + layer * 7_919
    pattern = _mix(seed + part_ids[:, None, None] * 104_729 + head_ids[None, :, None] * 65_537
                   + elems[None, None, :] * 2_654_435_761).to(torch.uint8)          # [parts, heads, E]
    tok = tokens.to(device=device, dtype=torch.int64)
    h = _mix(_mix(tok * 0x9E3779B1 + seed)[:, None] + part_ids[None, :] * 0x85EBCA77)  # [T, parts]
    a = ((h & 0xFF) | 1).to(torch.uint8)
    b = ((h >> 8) & 0xFF).to(torch.uint8)
    return pattern[None] * a[:, :, None, None] + b[:, :, None, None]


@dataclass
class PoolBuffer:
    pool: str
    tensor: torch.Tensor
    layers: tuple[int, ...]
    heads: tuple[int, int]
    parts: int
    row_bytes: int

    def view(self, layer: int) -> torch.Tensor:
        """[parts, num_blocks, heads, block_size, row_bytes] of one global layer."""
        return self.tensor[self.layers.index(layer)]


class RankBuffers:
    """Every pool of one rank, allocated and described as Regions."""

    def __init__(self, model: ModelLayout, parallel: ParallelLayout, rank: tuple[int, int], block_size: int,
                 num_blocks: int, device: str = "cpu") -> None:
        self.model, self.block_size, self.num_blocks = model, block_size, num_blocks
        self.device = torch.device(device)
        self.layout = RankLayout(model, parallel, rank[0], rank[1])
        self.pools: dict[str, PoolBuffer] = {}
        for name in POOLS:
            spec, layers = model.pools[name], self.layout.layers(name)
            if not layers:
                continue
            heads = self.layout.heads(name)
            row_bytes = spec.bytes_per_token_per_head // spec.num_parts
            shape = (len(layers), spec.num_parts, num_blocks, heads[1] - heads[0], block_size, row_bytes)
            tensor = torch.zeros(shape, dtype=torch.uint8, device=self.device)
            self.pools[name] = PoolBuffer(name, tensor, layers, heads, spec.num_parts, row_bytes)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [b.tensor for b in self.pools.values()]

    def regions(self) -> list[Region]:
        out = []
        for buf in self.pools.values():
            _, parts, nb, heads, bs, row = buf.tensor.shape
            bytes_per_block = heads * bs * row
            for slot, layer in enumerate(buf.layers):
                out.append(Region(
                    pool=buf.pool, layer=layer, slot=slot,
                    base_addr=buf.tensor.data_ptr() + slot * parts * nb * bytes_per_block,
                    num_blocks=nb, bytes_per_block=bytes_per_block, block_stride=bytes_per_block,
                    heads=buf.heads, num_parts=parts, part_stride=nb * bytes_per_block,
                    device_id=self.device.index or 0, group=POOL_GROUP[buf.pool], token_layout=((1, row),)))
        return out

    def _index(self, block_ids: list[int], t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = torch.arange(t0, t1, dtype=torch.int64)
        ids = torch.tensor(block_ids, dtype=torch.int64)
        return tokens, ids[tokens // self.block_size].to(self.device), (tokens % self.block_size).to(self.device)

    def fill(self, layer: int, block_ids: list[list[int]], t0: int, t1: int) -> None:
        """Write tokens [t0, t1) of `layer` (every pool this rank keeps for it) into its blocks, and nothing else:
        the unfilled tail of a partial block stays as it was, as in a real cache."""
        for buf in self.pools.values():
            if layer in buf.layers:
                tokens, blk, off = self._index(block_ids[POOL_GROUP[buf.pool]], t0, t1)
                data = content(buf.pool, layer, tokens, buf.heads, buf.parts, buf.row_bytes, self.device)
                buf.view(layer)[:, blk, :, off, :] = data  # advanced dims go first: [T, parts, heads, E]

    def verify(self, block_ids: list[list[int]], t0: int, t1: int) -> list[str]:
        """Mismatches (empty = byte-exact) for tokens [t0, t1) of every pool and layer this rank holds."""
        problems = []
        for buf in self.pools.values():
            tokens, blk, off = self._index(block_ids[POOL_GROUP[buf.pool]], t0, t1)
            for layer in buf.layers:
                got = buf.view(layer)[:, blk, :, off, :]
                want = content(buf.pool, layer, tokens, buf.heads, buf.parts, buf.row_bytes, self.device)
                bad = (got != want).reshape(got.shape[0], -1).any(dim=1)
                if bool(bad.any()):
                    first = int(tokens[int(bad.nonzero()[0])])
                    problems.append(f"{buf.pool} layer {layer}: {int(bad.sum())} of {len(tokens)} tokens differ, "
                                    f"first at token {first}")
        return problems

    def zero_blocks(self, block_ids: list[list[int]]) -> None:
        """Zero these blocks (per group) in every pool and layer."""
        for buf in self.pools.values():
            ids = torch.tensor(block_ids[POOL_GROUP[buf.pool]], dtype=torch.int64, device=self.device)
            buf.tensor[:, :, ids] = 0

    def verify_prefix_untouched(self, block_ids: list[list[int]], first_token: int) -> list[str]:
        """Blocks before `first_token` are decode's own prefix-cache hits: the transfer must not touch them."""
        problems = []
        for buf in self.pools.values():
            ids = torch.tensor(block_ids[POOL_GROUP[buf.pool]][: first_token // self.block_size], dtype=torch.int64)
            if ids.numel() and bool(buf.tensor[:, :, ids.to(self.device)].any()):
                problems.append(f"{buf.pool}: prefix-hit blocks (tokens < {first_token}) were overwritten")
        return problems

    def untouched(self, used: list[list[int]]) -> list[str]:
        """Blocks never registered must still be all zero: nothing was written outside the request."""
        problems = []
        for buf in self.pools.values():
            mask = torch.ones(self.num_blocks, dtype=torch.bool)
            mask[torch.tensor(used[POOL_GROUP[buf.pool]], dtype=torch.int64)] = False
            idx = mask.nonzero().flatten().to(self.device)
            if idx.numel() and bool(buf.tensor[:, :, idx].any()):
                problems.append(f"{buf.pool}: bytes written into blocks that were never registered")
        return problems


def pick_blocks(num_tokens: int, block_size: int, num_blocks: int, seed: int, run_blocks: int = 1) -> list[list[int]]:
    """Random distinct block ids per group, in runs of about `run_blocks` consecutive ids (1 = fully scattered)."""
    need = blocks_for(num_tokens, block_size)
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(NUM_GROUPS):
        run = max(1, run_blocks)
        n_runs = num_blocks // run
        order = torch.randperm(n_runs, generator=gen).tolist()
        ids = [r * run + i for r in order for i in range(run)]
        if len(ids) < need:
            raise ValueError(f"{num_blocks} blocks cannot hold {num_tokens} tokens at block size {block_size}")
        groups.append(ids[:need])
    return groups
